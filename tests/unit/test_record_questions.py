"""A node answers questions for its rounds records (``ContributionServicer.rpc_record``) and counts them by group,
for a bounded number of group names: a peer names any it likes."""

from __future__ import annotations

import asyncio

from hivemind.proto import runtime_pb2

from parallax.node.outer.transport import ContributionServicer, ContributionStore


def test_questions_for_records_are_counted_apart_for_a_bounded_number_of_group_names() -> None:
    servicer = ContributionServicer(ContributionStore(keep=2))
    loop = asyncio.new_event_loop()
    try:
        for name in [f"g{i}" for i in range(300)] + ["g0", "x" * 10_000]:  # an unknown group is answered at once
            answer = loop.run_until_complete(servicer.rpc_record(runtime_pb2.ExpertRequest(uid=f"{name}/tag"),
                                                                 None))  # type: ignore[arg-type]
            assert answer.serialized_info == b""  # no record of it here
    finally:
        loop.close()
    assert len(servicer.records_asked) == 257  # 256 names, and the rest together
    assert servicer.records_asked["g0"] == 2 and servicer.records_asked["g255"] == 1
    assert servicer.records_asked[""] == 300 - 256 + 1
