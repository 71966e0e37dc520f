"""HTTPS and WSS: the gateway behind uvicorn's TLS, with a throwaway self-signed cert."""

import json
import shutil
import ssl

import httpx
import openai
import pytest
import websockets

from once.bench.gateway_bench.tls import make_certificate
from tests.gateway.conftest import MODEL, scripted_texts, serve_gateway

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


async def test_https_and_wss_serve_the_same_api(runtime, tmp_path):
    cert, key = make_certificate(tmp_path)
    context = ssl.create_default_context(cafile=str(cert))
    engine = scripted_texts(runtime, ["over https", "over wss"])
    async with serve_gateway(runtime, engine, tls=(cert, key)) as (url, _):
        assert url.startswith("https://")
        http = httpx.AsyncClient(verify=context)
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="x", http_client=http, max_retries=0
        )
        response = await client.responses.create(model=MODEL, input="hi")
        assert response.output_text == "over https"
        wss = url.replace("https://", "wss://") + "/v1/responses"
        async with websockets.connect(wss, ssl=context) as socket:
            await socket.send(json.dumps({"type": "response.create", "model": MODEL, "input": "x"}))
            while (event := json.loads(await socket.recv()))["type"] != "response.completed":
                assert event["type"] != "error", event
        assert event["response"]["output"][0]["content"][0]["text"] == "over wss"
        # A client that does not trust the certificate is refused at the handshake.
        with pytest.raises(httpx.ConnectError):
            await httpx.AsyncClient().get(f"{url}/healthz")
        await http.aclose()
