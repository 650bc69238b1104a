"""`splitserve profile`: measure a model's prefill and decode on the devices at hand, then
recommend a prefill/decode split that meets a TTFT and TPOT target (docs/profile.md).

    curves.py    the measured curves (prefill time against prompt length, decode step time
                 against batch and context, per TP degree), read back and interpolated
    measure.py   measuring them with the offline engine, in this process
    queueing.py  waiting time on c identical servers (Erlang C, M/G/c by Allen-Cunneen)
    plan.py      the prediction for one split, the search over splits, the recommendation
    report.py    the table, the JSON and the plot

Nothing here but `measure.py` loads torch: a split is planned again from a saved JSON with no
engine.
"""
