"""``parallax bench bytes``: measured body sizes under each wire, and the transports' schedules against n."""

from __future__ import annotations

from parallax.benchmarks.bytes import body_bytes, markdown, run_bytes


def test_gathered_bytes_grow_with_the_swarm_and_the_default_and_the_all_reduce_stay_bounded() -> None:
    report = run_bytes("tiny", [4, 64])
    per_round = report["bytes_per_peer_per_round"]
    bodies = report["body_bytes"]
    for wire in ("fp16", "uint8", "int4", "topk"):
        body = sum(b[wire] for b in bodies.values())
        assert per_round[f"gather_{wire}"] == {"4": 3 * body, "64": 63 * body}
    payload = sum(report["allreduce_payload_bytes"].values())
    assert per_round["allreduce_uint8"]["4"] < per_round["allreduce_uint8"]["64"] < 2 * payload
    assert report["default"] == "parts_int4" and per_round["default"] == per_round["parts_int4"]
    assert per_round["gather"] == per_round["gather_int4"]  # the gathered round on the default wire
    assert per_round["default"]["4"] < per_round["default"]["64"] < 2 * per_round["default"]["4"]
    assert "| gather_topk |" in markdown(report)


def test_the_sparse_wire_sends_a_few_percent_of_a_large_tensor_and_the_4_bit_one_about_half() -> None:
    shapes = {"w": (512, 512)}
    assert body_bytes(shapes, "topk") * 20 < body_bytes(shapes, "uint8") < body_bytes(shapes, "fp16")
    assert 0.5 < body_bytes(shapes, "int4") / body_bytes(shapes, "uint8") < 0.51
