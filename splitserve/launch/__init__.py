"""Starting and wiring processes: one service in this process (`services.py`; what every
worker's start shares in `worker_start.py`, what every worker that serves decode shares in
`decode_start.py`, its engine and registry record in `workers.py`, its engine core in
`engine_core.py`, its KV transports in `kv_transports.py`; the gateway in `gateway_service.py`
and N of them in `gateway_processes.py`), and the whole stack as processes (`up.py`,
`stack.py`, `ports.py`, the model it serves by default in `default_model.py`).
"""
