"""Which set of contributions a gathered round merges when its peers merged different ones (pure: the rounds
records as data, no network)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from parallax.node.outer.gathered import (
    GatheredRounds,
    _better_set,
    _first_ranked,
    _may_yet_agree,
    _moved_on,
    _off_offer,
)
from parallax.node.outer.records import POLL_S, Records
from parallax.node.outer.transport import (
    WITHDRAWN,
    RoundEntry,
    RoundPeers,
    decode_entries,
    encode_record,
    merged_sets,
    open_contributions,
    pair,
    split_pair,
    vouched,
)
from parallax.node.outer.wire import OuterSyncConfig, encode_fingerprint, round_tag

PEERS = ("A", "B", "C", "D")
MINE = pair("A", 4)


def _entry(peer: str, n: int, merged: tuple[str, ...]) -> dict[int, RoundEntry]:
    return {n: RoundEntry(n, bytes(32), 100, 1.0, fingerprint=b"fp", participants=merged)}


def _names(*peers: str) -> tuple[str, ...]:
    rounds = {"A": 4, "B": 3, "C": 6, "D": 5}
    return tuple(sorted(pair(p, rounds[p]) for p in peers))


def test_a_set_its_senders_already_verified_is_taken_over_one_that_cannot_verify() -> None:
    """A and B merged all four contributions; C and D merged A's, C's and D's, which verified among them (two of
    its three senders). A's set can reach no majority any more (C and D applied theirs): A takes theirs, even
    though as many peers merged A's (a tie kept A's set before, and the round was lost at A)."""
    everyone, theirs = _names(*PEERS), _names("A", "C", "D")
    entries = {"B": _entry("B", 3, everyone), "C": _entry("C", 6, theirs), "D": _entry("D", 5, theirs)}
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=3) == theirs


def test_without_a_final_set_only_a_clearly_better_supported_one_is_taken() -> None:
    everyone, other = _names(*PEERS), _names("A", "B", "C")
    # One other peer each: a tie is no reason to switch, and no set is final (1 of 4, 1 of 3).
    entries = {"B": _entry("B", 3, everyone), "C": _entry("C", 6, other)}
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=3) is None
    # A set that one more peer merged than ours (with our own vote) is taken.
    entries = {"B": _entry("B", 3, other), "C": _entry("C", 6, other)}
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=3) == other


def test_a_final_set_of_a_banned_or_absent_peer_or_below_the_quorum_is_not_taken() -> None:
    everyone, theirs = _names(*PEERS), _names("A", "C", "D")
    entries = {"C": _entry("C", 6, theirs), "D": _entry("D", 5, theirs)}
    assert _better_set(entries, MINE, everyone, lambda p: p != "D", quorum=3) is None
    assert _better_set(entries, MINE, everyone, lambda _p: True, quorum=4) is None


def test_a_sender_has_moved_on_only_once_its_vote_on_that_contribution_is_final() -> None:
    """B's contribution of round 3 is in our set. B's vote on our set is never coming once B withdrew it, or merged
    it in another set and published a later round; while B is still verifying another set it may switch to ours,
    and a fingerprint for our set is a vote, not a refusal."""
    ours, theirs = round_tag(0, _names(*PEERS)), round_tag(0, _names("B", "C", "D"))
    fp = (1.0, 2.0, 3.0, 4.0)

    def record(*entries: RoundEntry) -> dict[int, RoundEntry]:  # as the sender's record reads back
        return decode_entries(encode_record(list(entries)))

    def merged(n: int, tag: bytes) -> RoundEntry:
        return RoundEntry(n, bytes(32), 100, 1.0, fingerprint=encode_fingerprint(fp, tag), participants=("x@1",))

    b3 = pair("B", 3)
    later = RoundEntry(4, bytes(32), 100, 1.0)
    assert _moved_on(b3, record(merged(3, theirs), later), ours)
    assert _moved_on(b3, record(RoundEntry(3, bytes(32), 100, 1.0, fingerprint=WITHDRAWN)), ours)
    assert not _moved_on(b3, record(merged(3, theirs)), ours)  # still verifying: it may take ours
    assert not _moved_on(b3, record(merged(3, ours), later), ours)  # it merged ours: a vote
    assert not _moved_on(b3, record(RoundEntry(3, bytes(32), 100, 1.0), later), ours)  # open: not merged yet
    assert not _moved_on(b3, record(later), ours)  # round 3 left its record: unknown


def test_a_verification_waits_on_while_enough_senders_still_gather_to_make_a_majority() -> None:
    """A merged all four and agrees with itself. While B and C still gather (their contributions on offer, unmerged)
    a majority may come; once C went on to a later round, or B merged another set, or A's round is told to end, it
    cannot (D's vote never came)."""
    everyone, due = _names(*PEERS), threading.Event()
    gathering = {"B": {3: RoundEntry(3, bytes(32), 100, 1.0)}, "C": {6: RoundEntry(6, bytes(32), 100, 1.0)}}
    assert _may_yet_agree(1, gathering, participants=everyone, due=due)
    went_on = {**gathering, "C": {6: RoundEntry(6, bytes(32), 100, 1.0), 7: RoundEntry(7, bytes(32), 100, 1.0)}}
    assert not _may_yet_agree(1, went_on, participants=everyone, due=due)
    merged_elsewhere = {**gathering, "B": _entry("B", 3, _names("A", "B", "C"))}
    assert not _may_yet_agree(1, merged_elsewhere, participants=everyone, due=due)
    assert _may_yet_agree(2, merged_elsewhere, participants=everyone, due=due)  # B agreed: B and C make three
    due.set()
    assert not _may_yet_agree(1, gathering, participants=everyone, due=due)


class _Answers:
    """``RecordWatch`` for ``_Scripted``: the peers in ``asked`` answer with their record once followed, the others
    do not."""

    def __init__(self, asked: dict[str, bytes]) -> None:
        self.asked = asked
        self.followed: set[str] = set()
        self.version = 0

    def wait(self, version: int, timeout_s: float) -> int:  # the answers never change
        time.sleep(min(timeout_s, POLL_S))
        return version

    def follow(self, peers) -> dict[str, bytes]:
        self.followed = set(peers)
        return self.heard(peers)

    def heard(self, peers) -> dict[str, bytes]:
        return {peer: record for peer, record in self.asked.items()
                if record and peer in peers and peer in self.followed}

    def stop(self) -> None:
        pass


class _Scripted(GatheredRounds):
    """A node ``A`` whose DHT reads return ``script``'s entries in turn (the last one from then on), whose peers in
    ``asked`` answer its questions with their record (the others do not: they are read from the DHT), and whose
    fetches return at once: ``_collect``'s decisions, with no network."""

    def __init__(self, script: list[dict[str, dict[int, RoundEntry]]], peers: RoundPeers,
                 asked: dict[str, bytes] | None = None, **timings: float) -> None:
        records = SimpleNamespace(group="router", peer_id="A", signer=None, run_id="run", on_read=None,
                                  store=lambda value: True, read=self._dht_read)
        super().__init__(records, {"w": (4,)}, OuterSyncConfig.loopback(aggregation="gather", **timings),
                         SimpleNamespace(store=None), peers, weight_cap=None, scores=None,
                         report=lambda *a, **k: None)
        self.script, self.reads = script, 0
        self._watch = self.answers = _Answers(asked or {})
        self.read_peers: list[list[str]] = []
        """The peers each DHT read was for."""

    def _dht_read(self, peers: list[str], timeout_s: float) -> Records:
        self.reads += 1
        self.read_peers.append(list(peers))
        entries = self.script[min(self.reads, len(self.script)) - 1]
        return Records({peer: encode_record(list(entries[peer].values())) for peer in peers if peer in entries})

    def _fetch(self, name: str, entry: RoundEntry) -> tuple[dict[str, torch.Tensor], float]:
        return {"w": torch.zeros(4)}, 1.0


def _ranked(first: str, *others: str) -> dict[str, str]:
    """Pairs of ``first`` and ``others`` (peer -> pair) such that ``first``'s ranks first among them."""
    for n in range(1000):
        names = {first: pair(first, n), **{peer: pair(peer, 1) for peer in others}}
        if _first_ranked("run", "router", names.values()) == names[first]:
            return names
    raise AssertionError("no round number ranks first")


def _open(*names: str) -> dict[str, dict[int, RoundEntry]]:
    return {split_pair(name)[0]: {split_pair(name)[1]: RoundEntry(split_pair(name)[1], bytes(32), 100, 1.0)}
            for name in names}


def test_contributions_on_offer_count_in_the_quorum_of_a_node_whose_view_of_work_is_narrow() -> None:
    """Only B's work has reached A (its view of who works is narrow), while B, C, D and E offer contributions: A's
    quorum is a majority of the five of them and itself, as a node that saw everyone's work counts it, so A neither
    merges a set of two that nobody else takes nor ends its wait before the others' contributions reach it. An
    offered contribution that A failed to fetch, or whose sender held a fetch, raises no quorum."""
    live = ["A", "B", "C", "D", "E", "F"]
    rounds = _Scripted([], RoundPeers(lambda: live, lambda: ["B"]))
    try:
        on_offer = _open(*(pair(peer, n) for n, peer in enumerate("BCDE", start=2)))
        assert rounds._quorum() == 2  # A and B
        assert rounds._offered(on_offer) == {"B", "C", "D", "E"}
        assert rounds._quorum(rounds._offered(on_offer)) == 3  # of five
        rounds._failing["C"] = None  # its latest fetch failed
        rounds._held["D"] = None  # it held a fetch
        assert rounds._offered(on_offer) == {"B", "E"}
        merged = {**on_offer, "E": _entry("E", 5, _names("A", "B"))}  # E's contribution is merged: off offer
        assert rounds._offered(merged) == {"B"}
    finally:
        rounds.close()


def test_a_download_asks_first_the_peers_whose_work_arrived_and_those_their_records_vouch_for() -> None:
    """S1-S3 name each other as the senders of a merged round (identities one attacker holds can): before any work
    reached A, the records vouch for them as for B, C and D, who merged each other's, though every live composer
    counts as working then (nobody is judged before work flows); once B's contribution arrived, a download asks
    first B and the peers B's record names, not those only the others' records name. A contribution of zeros shows
    no work."""
    honest, sybils = _names("B", "C", "D"), ("S1@1", "S2@1", "S3@1")
    entries = {peer: _entry(peer, 1, honest) for peer in "BCD"} | {s[:2]: _entry(s[:2], 1, sybils) for s in sybils}
    live = ["A", "B", "C", "D", "S1", "S2", "S3"]
    node = _Scripted([entries], RoundPeers(lambda: live, lambda: live))
    try:
        assert node.hear_proofs(1.0) == {"B", "C", "D", "S1", "S2", "S3"}
        node._worked("S1", tensors={"w": torch.zeros(4)})
        assert node.hear_proofs(1.0) == {"B", "C", "D", "S1", "S2", "S3"}
        node._worked("B", tensors={"w": torch.ones(4)})
        assert node.hear_proofs(1.0) == {"B", "C", "D"}
    finally:
        node.close()


def test_one_contribution_on_offer_ranks_first_on_every_node_and_another_one_next_round() -> None:
    """Of the contributions on offer, the same one ranks first wherever it is computed (its sender merges at once,
    the others wait for its set); the rank changes with the rounds, so no sender leads every round."""
    names = [pair(peer, n) for peer, n in {"A": 4, "B": 3, "C": 6, "D": 5}.items()]
    assert len({_first_ranked("run", "router", order) for order in (names, names[::-1], sorted(names))}) == 1
    firsts = {_first_ranked("run", "router", [pair(peer, n) for peer in "ABCD"]).split("@")[0] for n in range(20)}
    assert len(firsts) > 1


def test_a_round_notes_when_each_contribution_was_first_read_on_offer_those_given_to_a_set_included() -> None:
    """A reads B's contribution on offer first and C's two reads later, when C has given it to B's announced set: the
    set's last contribution came at the third read (``RoundReport.waited_s`` counts to it)."""
    names = _ranked("A", "B", "C")
    announced = tuple(sorted(names.values()))
    c_round = split_pair(names["C"])[1]
    given = {**_open(names["B"]), "C": {c_round: RoundEntry(c_round, bytes(32), 100, 1.0, participants=announced)}}
    node = _Scripted([_open(names["B"]), _open(names["B"]), given], RoundPeers(lambda: ["A", "B", "C"]),
                     min_matchmaking_time_s=1.0, matchmaking_timeout_s=1.5)
    seen: dict[str, float] = {}
    try:
        found: dict[str, tuple[dict[str, torch.Tensor], float]] = {names["A"]: ({"w": torch.zeros(4)}, 1.0)}
        node._collect(names["A"], found, seen=seen)
        assert node.reads >= 3 and seen[names["B"]] < seen[names["C"]], (node.reads, seen)
    finally:
        node.close()


def test_a_node_that_holds_a_quorum_gives_the_first_ranked_sender_time_to_publish_a_set_naming_its_own() -> None:
    """A, B and C each hold all three contributions; B's ranks first. A does not merge the three it holds at once:
    it waits for B's set (B had not fetched C's yet: a set of A's and B's) and takes it, so the two merge one set."""
    names = _ranked("B", "A", "C")
    on_offer = _open(names["B"], names["C"])
    merged = {**on_offer, "B": _entry("B", split_pair(names["B"])[1], tuple(sorted((names["A"], names["B"]))))}
    node = _Scripted([on_offer] * 5 + [merged], RoundPeers(lambda: ["A", "B", "C"]), verify_timeout_s=30.0,
                     matchmaking_timeout_s=60.0)
    try:
        found: dict[str, tuple[dict[str, torch.Tensor], float]] = {names["A"]: ({"w": torch.zeros(4)}, 1.0)}
        assert node._collect(names["A"], found) == tuple(sorted((names["A"], names["B"])))
        assert node.reads == 6
    finally:
        node.close()


def test_the_first_ranked_senders_set_is_seen_in_its_own_answer_before_the_dht_shows_it() -> None:
    """As above, but the DHT never shows B's set: B, asked directly, gives its record naming the set, and A takes
    that set without waiting out its deferral; C, which does not answer, is read from the DHT."""
    names = _ranked("B", "A", "C")
    on_offer = _open(names["B"], names["C"])
    ours = tuple(sorted((names["A"], names["B"])))
    record = encode_record(list(_entry("B", split_pair(names["B"])[1], ours).values()))
    node = _Scripted([on_offer], RoundPeers(lambda: ["A", "B", "C"]), asked={"B": record}, verify_timeout_s=30.0,
                     matchmaking_timeout_s=60.0)
    try:
        found: dict[str, tuple[dict[str, torch.Tensor], float]] = {names["A"]: ({"w": torch.zeros(4)}, 1.0)}
        assert node._collect(names["A"], found) == ours
        assert node.answers.followed == {"B", "C"} and node.reads > 0
        assert all(peers in (["B", "C"], ["C"]) for peers in node.read_peers), node.read_peers
    finally:
        node.close()


def test_a_peers_answer_stands_for_its_record_and_is_shown_to_the_witness_once() -> None:
    """B answers A's question with its record, C does not: every read takes B's entries from its answer and C's
    from the DHT (a read for C alone, but once a second for both: the witness sees what B stores too), and the witness
    is shown B's answer once, not at every read."""
    record = encode_record(list(_entry("B", 3, _names("A", "B")).values()))
    node = _Scripted([_open(pair("C", 6))], RoundPeers(lambda: ["A", "B", "C"]), asked={"B": record})
    shown: list[dict[str, bytes]] = []
    node._read = lambda records: shown.append(dict(records))  # type: ignore[method-assign]  # what the witness sees
    try:
        for _ in range(3):
            assert node._entries_of_live(1.0) == {"B": decode_entries(record), **_open(pair("C", 6))}
        assert node.read_peers == [["B", "C"], ["C"], ["C"]] and shown == [{"B": record}]
    finally:
        node.close()


def test_a_live_peer_that_shows_no_work_is_asked_for_its_record_once_one_is_found() -> None:
    """B shows work, C and D do not: B is asked for its record from the first read, C from the read that found one
    of its, D (none found) never: it is read from the DHT, in the one request that reads the others."""
    node = _Scripted([{}, _open(pair("C", 2))], RoundPeers(lambda: ["A", "B", "C", "D"], lambda: ["B"]))
    try:
        node._entries_of_live(1.0)
        assert node.answers.followed == {"B"}
        node._entries_of_live(1.0)  # C's record shows
        assert node.answers.followed == {"B", "C"}
        node._entries_of_live(1.0)
        assert node.answers.followed == {"B", "C"} and all("D" in peers for peers in node.read_peers)
    finally:
        node.close()


def test_a_node_that_does_not_rank_first_merges_the_quorum_it_holds_when_its_wait_runs_out() -> None:
    """Only C offers a contribution (B is live, never offers), and C's ranks first: A's quorum (two of three) comes
    when its first wait ends, and no set of C's shows. A merges the two when its round's time runs out, not
    nothing."""
    names = _ranked("C", "A")
    node = _Scripted([_open(names["C"])], RoundPeers(lambda: ["A", "B", "C"]), min_matchmaking_time_s=1.0,
                     matchmaking_timeout_s=1.5)
    try:
        found: dict[str, tuple[dict[str, torch.Tensor], float]] = {names["A"]: ({"w": torch.zeros(4)}, 1.0)}
        assert node._collect(names["A"], found) == tuple(sorted((names["A"], names["C"])))
        assert node.read_peers[0] == ["B", "C"]  # neither answered: both read from the DHT
    finally:
        node.close()


def test_a_contribution_its_sender_gave_to_an_announced_set_is_on_offer_to_that_set_only():
    """Partitioned, B names the set it merges (A, B, C) before its result: A and C take that set; D, left out, sees
    B's contribution off offer and builds no set around it that B would never vote for."""
    announced = (pair("A", 4), pair("B", 7), pair("C", 2))
    entries = {"A": {4: RoundEntry(4, bytes(32), 100, 1.0)},
               "B": {7: RoundEntry(7, bytes(32), 100, 1.0, participants=announced)},
               "C": {2: RoundEntry(2, bytes(32), 100, 1.0)},
               "D": {5: RoundEntry(5, bytes(32), 100, 1.0)}}
    assert set(open_contributions(entries)) == {pair("A", 4), pair("C", 2), pair("D", 5)}
    assert merged_sets(entries, pair("A", 4), announced=True) == {announced: 1}
    assert merged_sets(entries, pair("D", 5), announced=True) == {}
    entries["B"][7] = RoundEntry(7, bytes(32), 100, 1.0, fingerprint=WITHDRAWN)  # withdrawn: off offer too
    assert pair("B", 7) not in open_contributions(entries)


def test_a_fetched_contribution_its_sender_merged_in_a_set_naming_ours_is_kept_until_that_set_cannot_be_taken() -> None:
    """B merged its round-3 contribution in a set that names A's: A may take that set, so the body A fetched stays
    held (forgotten, it would be fetched again). It goes once B is gone, withdrew it or published a later round, and
    at once when B's set does not name A's (nothing will ask for it)."""
    mine = pair("A", 4)
    merged = _entry("B", 3, (mine, pair("B", 3), pair("C", 6)))
    assert not _off_offer(pair("B", 3), live={"B", "C"}, entries={"B": merged}, mine=mine)
    assert not _off_offer(pair("B", 3), live={"B", "C"}, entries={}, mine=mine)  # a read that missed B judges nothing
    assert _off_offer(pair("B", 3), live={"C"}, entries={"B": merged}, mine=mine)
    later = merged | {4: RoundEntry(4, bytes(32), 100, 1.0)}
    assert _off_offer(pair("B", 3), live={"B", "C"}, entries={"B": later}, mine=mine)
    withdrawn = {3: RoundEntry(3, bytes(32), 100, 1.0, fingerprint=WITHDRAWN)}
    assert _off_offer(pair("B", 3), live={"B", "C"}, entries={"B": withdrawn}, mine=mine)
    without_ours = _entry("B", 3, (pair("B", 3), pair("C", 6)))
    assert _off_offer(pair("B", 3), live={"B", "C"}, entries={"B": without_ours}, mine=mine)
    on_offer = {3: RoundEntry(3, bytes(32), 100, 1.0)}
    assert not _off_offer(pair("B", 3), live={"B", "C"}, entries={"B": on_offer}, mine=mine)


def test_a_peer_is_vouched_for_by_two_other_peers_merged_rounds_that_name_it_never_by_its_own() -> None:
    open_entry = {7: RoundEntry(7, bytes(32), 100, 1.0)}  # on offer, not merged: it vouches for nobody
    entries = {
        "A": _entry("A", 4, (pair("A", 4), pair("B", 4), pair("D", 4))),
        "C": {**_entry("C", 5, (pair("C", 5), pair("D", 3), pair("B", 5))), **open_entry},
        "S": _entry("S", 4, (pair("S", 4),)),  # a merge of itself alone
        "T": open_entry | {3: RoundEntry(3, bytes(32), 100, 1.0, participants=(pair("U", 3),))},  # no fingerprint
        "W": {2: RoundEntry(2, bytes(32), 100, 1.0, fingerprint=WITHDRAWN, participants=(pair("V", 2),))},
        # One node naming identities it made up as the senders of a round it says it merged vouches for none alone.
        "X": _entry("X", 6, tuple(pair(f"Sybil{i}", 6) for i in range(30))),
    }
    assert vouched(entries) == {"B", "D"}
    assert vouched(entries, least=1) == {"B", "D", *(f"Sybil{i}" for i in range(30))}
    two = {"A": _entry("A", 4, (pair("A", 4), pair("C", 4))), "C": _entry("C", 4, (pair("A", 4), pair("C", 4)))}
    assert vouched(two) == set() and vouched(two, least=1) == {"A", "C"}
    assert vouched({}) == set()


def test_only_the_records_of_peers_that_run_vouch_when_they_are_named() -> None:
    """Records stored under identities nobody runs, each naming the others among the senders of a round it merged,
    vouch for each other; counted only from the peers that served a state (``by``), they vouch for nobody."""
    honest = {p: _entry(p, 4, (pair("A", 4), pair("B", 4), pair("C", 4))) for p in "ABC"}
    sybils = [f"Sybil{i}" for i in range(5)]
    clique = {s: _entry(s, 4, tuple(pair(t, 4) for t in sybils)) for s in sybils}
    entries = {**honest, **clique}
    assert vouched(entries) == {"A", "B", "C", *sybils}
    assert vouched(entries, by={"A", "B", "C"}) == {"A", "B", "C"}
    assert vouched(entries, by={"A", "B"}) == {"C"}  # A and B name each other once each: one voucher apiece
    assert vouched(entries, by={"A", "Sybil0", "Sybil1"}) == {"Sybil2", "Sybil3", "Sybil4"}  # Sybils that run
    assert vouched(entries, by=set()) == set()
