"""The wire over TLS end to end: a real edge and node with certificates made in the test."""

from __future__ import annotations

import trio
import trustme

from tests.support.gateway import in_thread, node_token, running_gateway, token_hash

YAML = """
edge:
  id: edge-tls
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  tls: {{cert: {cert}, key: {key}, client_ca: {client_ca}}}
openai:
  listen: 127.0.0.1:0
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: node-a
    token_hash_sha256: {hash}
    providers:
      - {{id: echo-1, type: echo, models: [echo]}}
"""


def _certs(tmp_path):  # type: ignore[no-untyped-def]
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("node-a.iopd.test")
    paths = {}
    for name, blob in (
        ("ca.pem", ca.cert_pem),
        ("server.pem", server.cert_chain_pems[0]),
        ("server.key", server.private_key_pem),
        ("client.pem", client.cert_chain_pems[0]),
        ("client.key", client.private_key_pem),
    ):
        path = tmp_path / name
        blob.write_to_path(str(path))
        paths[name] = str(path)
    return paths


async def test_edge_and_node_handshake_over_mutual_tls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = _certs(tmp_path)
    yaml_text = YAML.format(
        cert=p["server.pem"],
        key=p["server.key"],
        client_ca=p["ca.pem"],
        hash=token_hash(node_token("node-a")),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml_text, nodes=[]) as gw:
            await gw.start_node(
                "node-a",
                tls={"ca": p["ca.pem"], "cert": p["client.pem"], "key": p["client.key"],
                     "server_hostname": "127.0.0.1"},
            )
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "over tls"}]
                )
            )
            assert resp.choices[0].message.content == "over tls"


async def test_node_without_client_cert_is_not_admitted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = _certs(tmp_path)
    yaml_text = YAML.format(
        cert=p["server.pem"],
        key=p["server.key"],
        client_ca=p["ca.pem"],
        hash=token_hash(node_token("node-a")),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml_text, nodes=[]) as gw:
            from iopd.node.run import run_node

            cfg = gw.node_config(
                "node-a", tls={"ca": p["ca.pem"], "server_hostname": "127.0.0.1"}
            )
            async with trio.open_nursery() as n:
                n.start_soon(run_node, cfg)
                await trio.sleep(1.0)  # several dial attempts with the test backoff
                assert gw.runtime.hub.connected_since("node-a") is None
                n.cancel_scope.cancel()
            # The edge keeps serving: the admitted path still works.
            await gw.start_node(
                "node-a",
                tls={"ca": p["ca.pem"], "cert": p["client.pem"], "key": p["client.key"],
                     "server_hostname": "127.0.0.1"},
            )
            assert gw.runtime.hub.connected_since("node-a") is not None
