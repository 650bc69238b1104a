"""The OpenAI HTTP API behind the gateway's TLS certificate: the official client over HTTPS
with a private CA, plaintext refused on that port, and no plaintext HTTP API beyond loopback
unless --insecure."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest

from splitserve.launch.up import StackSettings
from splitserve.runtime.auth import ApiKeys
from splitserve.runtime.security import Security
from tests.e2e.harness import running_stack
from tests.security.test_tls_and_up import make_certificates

KEY = "https-test-key-3b8d01f4"


def test_beyond_loopback_the_http_api_needs_tls_or_insecure(tmp_path):
    keyed = Security(api_keys=ApiKeys((KEY,)))
    keyed.check_exposure("127.0.0.1", gateway=True, http=True)
    keyed.check_exposure("0.0.0.0", gateway=True, http=False)
    with pytest.raises(ValueError, match="--insecure"):
        keyed.check_exposure("0.0.0.0", gateway=True, http=True)
    _, chain, key = make_certificates(tmp_path)
    Security(
        api_keys=ApiKeys((KEY,)),
        tls_cert_chain=chain.read_bytes(),
        tls_private_key=key.read_bytes(),
    ).check_exposure("0.0.0.0", gateway=True, http=True)
    Security(api_keys=ApiKeys((KEY,)), insecure=True).check_exposure("0.0.0.0", True, http=True)

    with pytest.raises(ValueError, match="--tls-cert-file"):
        StackSettings(host="0.0.0.0", api_keys=(KEY,), http_port=0)
    StackSettings(host="0.0.0.0", api_keys=(KEY,), http_port=0, insecure=True)
    StackSettings(host="0.0.0.0", api_keys=(KEY,), tls_cert_file=str(chain),
                  tls_key_file=str(key), http_port=0)  # fmt: skip
    StackSettings(host="127.0.0.1", http_port=0)


@pytest.mark.slow
def test_the_openai_client_over_https_with_a_private_ca_and_plaintext_refused(
    tiny_models, tmp_path
):
    ca_file, chain_file, key_file = make_certificates(tmp_path)
    trusted = ssl.create_default_context(cafile=str(ca_file))
    with running_stack(
        tiny_models["llama"], prefill=0, decode=1, api_keys=(KEY,), http_port=0,
        tls_cert_file=str(chain_file), tls_key_file=str(key_file),
    ) as stack:  # fmt: skip
        assert stack.http_url is not None and stack.http_url.startswith("https://")
        with (
            httpx.Client(verify=trusted) as http,
            openai.OpenAI(
                base_url=stack.http_url, api_key=KEY, http_client=http, max_retries=0
            ) as client,
        ):
            model = client.models.list().data[0].id
            done = client.completions.create(
                model=model, prompt="hello there", max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert done.usage is not None and done.usage.completion_tokens == 4
            assert done.choices[0].finish_reason == "length"
        # the key still counts over TLS
        with (
            httpx.Client(verify=trusted) as http,
            openai.OpenAI(
                base_url=stack.http_url, api_key="not-a-key", http_client=http, max_retries=0
            ) as client,
            pytest.raises(openai.AuthenticationError),
        ):
            client.models.list()
        # a client that does not trust the private CA does not get through
        with (
            openai.OpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0) as client,
            pytest.raises(openai.APIConnectionError),
        ):
            client.models.list()
        # plaintext to the same port: no HTTP answer at all, the key never read
        plain = stack.http_url.replace("https://", "http://", 1)
        with pytest.raises(httpx.TransportError):
            httpx.get(plain + "/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
