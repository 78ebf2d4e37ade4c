#!/usr/bin/env python3
"""The history checker: reads a fault run's history (JSON lines) and nothing else.

It shares no code with what it judges: it imports neither the crate (it is Python) nor the
harness (`faults/harness/`), only the standard library, and knows the run only through the
history's plain records (the format is in `faults/README.md`). Its rules:

- token-order:  per SKU, the tokens of the writes the data accepted strictly increase.
- lost-update:  per SKU, each accepted write's stock is the previous accepted write's stock
                less the sale (a write computed from a stale read is named, with the writes it
                overwrote); the final stock is the last accepted write's; and the final stock
                is the initial stock less the 200s.
- ack-write:    each 200 is exactly one accepted write, with its request id and its token; an
                accepted write whose request got an answer other than 200 is a violation (the
                client was told "not done" for a write that landed); one whose request got no
                answer at all (its instance was killed) is indeterminate, and counted.
- overlap:      no two 200s of one SKU provably held the SKU at the same time, unless the
                history shows the older holder lost its lease (a fault that can end a lease hit
                its instance or the lock store while it ran): then it is reported, not counted.
- deadline:     every request answered within its deadline, plus the time its instance was
                paused while it ran, plus ANSWER_SLACK.
- recovery:     after each fault heals, every SKU, and every instance that is asked, answers a
                purchase that took the lock (200 or 422) within the TTL plus RECOVERY_SLACK.
- status:       every answer is 200, 409, 422 or 503.

Exit status: 0 when no rule is broken, 1 when one is, 2 when the history cannot be read.

    python3 faults/check.py HISTORY.jsonl [--figures] [--summary FILE.json]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Iterable

# Slack on top of each request's own deadline: the harness's clock readings (an asyncio event
# loop in Python, on a shared machine) and the kernel's scheduling, not the service's time.
ANSWER_SLACK = 1.0
# Slack on top of the TTL for every SKU to be sold again once a fault heals: a lease the fault
# orphaned runs out within the TTL; then a waiter's next attempt (its backoff, at most 100 ms
# between attempts by default), a store's reconnect (redis-rs reconnects after a refused
# connection with a backoff of its own), and the harness's next request for that SKU.
RECOVERY_SLACK = 2.0

# Statuses a purchase may answer: sold, lock held or stale write refused, out of stock, store
# or storage unavailable or lease lost.
ALLOWED_STATUSES = {200, 409, 422, 503}
# Answers that show the request held the SKU's lock.
ACQUIRED = {200, 422}
# Faults that can end a lease before its holder notices, and what they hit: the instance they
# name, or every instance (the lock store itself).
LEASE_ENDING_FAULTS = {
    "pause",  # the holder's process is frozen past its TTL
    "partition",  # its renewals do not reach Redis
    "slow-network",  # a renewal slower than what is left of the lease
    "redis-restart",  # Redis forgets every lease
    "sentinel-failover",  # the promoted replica may not have the latest leases
    "kill",  # (its requests answer nothing; listed for completeness)
}
STORE_WIDE = "lock-store"

EPS = 1e-9


class HistoryError(Exception):
    """The history is not one this checker can read."""


@dataclass(slots=True)
class Request:
    id: str
    op: str
    sku: str
    instance: str
    invoke: float
    complete: float | None
    status: int | None
    token: int | None
    stock: int | None
    work_ms: int
    deadline_ms: int
    error: str | None = None
    problem: str | None = None
    qty: int = 1

    @property
    def indeterminate(self) -> bool:
        """No HTTP answer, and it may have reached the service (not a refused connection)."""
        return self.status is None and self.error != "refused"

    @property
    def latency(self) -> float | None:
        return None if self.complete is None else self.complete - self.invoke

    def brief(self) -> str:
        outcome = (
            str(self.status)
            if self.status is not None
            else (self.error or "no answer")
        )
        end = "-" if self.complete is None else f"{self.complete:.3f}"
        token = "" if self.token is None else f" token {self.token}"
        return (
            f"{self.id} ({self.op} {self.sku} on {self.instance}, "
            f"[{self.invoke:.3f}, {end}], work {self.work_ms} ms, {outcome}{token})"
        )


@dataclass
class Fault:
    id: int
    kind: str
    target: str
    start: float
    end: float | None = None
    params: dict = field(default_factory=dict)

    def hits(self, instance: str) -> bool:
        return self.target in (instance, STORE_WIDE)

    def overlaps(self, start: float, end: float) -> bool:
        fault_end = math.inf if self.end is None else self.end
        return self.start <= end and start <= fault_end

    def brief(self) -> str:
        end = "never healed" if self.end is None else f"{self.end:.3f}"
        return f"fault {self.id} ({self.kind} of {self.target}, [{self.start:.3f}, {end}])"


@dataclass(slots=True)
class Entry:
    """One write the data accepted, from its journal."""

    index: int
    sku: str
    token: int | None
    stock: int
    instance: str | None
    request: str | None
    reset: bool


@dataclass
class History:
    run: dict
    requests: list[Request]
    faults: list[Fault]
    initial: dict[str, int]
    journal: list[Entry] | None
    final: dict[str, int]
    end: float | None

    @property
    def ttl(self) -> float:
        return self.run["ttl_ms"] / 1000


@dataclass
class Violation:
    rule: str
    text: str
    requests: list[str] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    # Findings that break no rule but a reader should see: overlaps explained by a lost
    # lease, writes whose request got no answer, rules that could not be checked.
    notes: list[str] = field(default_factory=list)
    counts: collections.Counter = field(default_factory=collections.Counter)
    recovery: dict[int, float | None] = field(default_factory=dict)

    def add(self, rule: str, text: str, requests=(), faults=()) -> None:
        self.violations.append(
            Violation(rule, text, [r.id for r in requests], [f.id for f in faults])
        )

    def by_rule(self) -> dict[str, int]:
        return dict(collections.Counter(v.rule for v in self.violations))


# -------------------------------------------------------------------------------------------
# Reading


def read_history(lines: Iterable[str]) -> History:
    run = None
    requests: list[Request] = []
    faults: dict[int, Fault] = {}
    initial: dict[str, int] = {}
    journal: list[Entry] | None = None
    journal_available = None
    final: dict[str, int] = {}
    end = None
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
            kind = event["type"]
            if kind == "run":
                run = event
                for name in ("ttl_ms",):
                    if not isinstance(event.get(name), (int, float)):
                        raise HistoryError(f"line {number}: the run record has no {name}")
            elif kind == "request":
                requests.append(
                    Request(
                        id=str(event["id"]),
                        op=event.get("op", "purchase"),
                        sku=event["sku"],
                        instance=event["instance"],
                        invoke=float(event["invoke"]),
                        complete=(
                            None if event.get("complete") is None else float(event["complete"])
                        ),
                        status=event.get("status"),
                        token=event.get("token"),
                        stock=event.get("stock"),
                        work_ms=int(event.get("work_ms", 0)),
                        deadline_ms=int(event["deadline_ms"]),
                        error=event.get("error"),
                        problem=event.get("problem"),
                        qty=int(event.get("qty", 1)),
                    )
                )
            elif kind == "fault":
                fid = int(event["id"])
                if event["phase"] == "start":
                    faults[fid] = Fault(
                        fid,
                        event["kind"],
                        event.get("target", STORE_WIDE),
                        float(event["t"]),
                        params=event.get("params", {}),
                    )
                elif event["phase"] == "end":
                    if fid not in faults:
                        raise HistoryError(f"line {number}: fault {fid} ends before it starts")
                    faults[fid].end = float(event["t"])
                else:
                    raise HistoryError(f"line {number}: unknown fault phase {event['phase']!r}")
            elif kind == "stock":
                initial[event["sku"]] = int(event["stock"])
            elif kind == "journal":
                if journal is None:
                    journal = []
                e = event["entry"]
                journal.append(
                    Entry(
                        index=int(event["index"]),
                        sku=e["sku"],
                        token=e.get("token"),
                        stock=int(e["stock"]),
                        instance=e.get("instance"),
                        request=e.get("request"),
                        reset=bool(e.get("reset", False)),
                    )
                )
            elif kind == "journal_end":
                journal_available = bool(event.get("available"))
            elif kind == "final":
                final[event["sku"]] = int(event["stock"])
            elif kind == "end":
                end = float(event["t"])
        except HistoryError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise HistoryError(f"line {number}: {type(e).__name__}: {e}") from e
    if run is None:
        raise HistoryError("no run record: is this a fault run's history?")
    if journal_available and journal is None:
        journal = []
    if not journal_available:
        journal = None
    if journal is not None:
        journal.sort(key=lambda e: e.index)
    return History(
        run, requests, sorted(faults.values(), key=lambda f: f.start), initial, journal, final, end
    )


# -------------------------------------------------------------------------------------------
# Rules


def check(history: History, answer_slack=ANSWER_SLACK, recovery_slack=RECOVERY_SLACK) -> Report:
    report = Report()
    report.counts["requests"] = len(history.requests)
    report.counts["200"] = sum(1 for r in history.requests if r.status == 200)
    check_statuses(history, report)
    check_deadlines(history, report, answer_slack)
    check_lost_updates(history, report)
    if history.journal is None:
        report.notes.append(
            "the history has no write journal (the service did not keep one): token-order, "
            "ack-write and the per-write lost-update rules were not checked; the final stocks "
            "were"
        )
    else:
        check_journal(history, report)
    check_overlaps(history, report)
    check_recovery(history, report, recovery_slack)
    return report


def check_statuses(history: History, report: Report) -> None:
    for r in history.requests:
        if r.status is not None and r.status not in ALLOWED_STATUSES:
            detail = f" ({r.problem})" if r.problem else ""
            report.add("status", f"unexpected status {r.status}{detail}: {r.brief()}", [r])


def paused_during(pauses: list[Fault], r: Request, end: float) -> float:
    """How long `r`'s instance was paused (`pauses`: that instance's) while `r` ran."""
    total = 0.0
    for f in pauses:
        f_end = end if f.end is None else f.end
        total += max(0.0, min(end, f_end) - max(r.invoke, f.start))
    return total


def check_deadlines(history: History, report: Report, slack: float) -> None:
    pauses: dict[str, list[Fault]] = collections.defaultdict(list)
    for f in history.faults:
        if f.kind == "pause":
            pauses[f.target].append(f)
    for r in history.requests:
        if r.complete is None:
            report.add("deadline", f"no answer at all: {r.brief()}", [r])
            continue
        allowed = r.deadline_ms / 1000 + paused_during(pauses[r.instance], r, r.complete) + slack
        if r.latency > allowed + EPS:
            report.add(
                "deadline",
                f"answered after {r.latency:.3f} s, allowed {allowed:.3f} s (deadline "
                f"{r.deadline_ms} ms + pauses + {slack} s slack): {r.brief()}",
                [r],
            )


def check_lost_updates(history: History, report: Report) -> None:
    """Final stock = initial stock less the 200s: the rule a client can check alone. A request
    that got no answer (its instance was killed, its connection cut) may or may not have sold:
    each such request widens the range by one sale."""
    sold = collections.Counter()
    unanswered = collections.Counter()
    for r in history.requests:
        if r.status == 200:
            sold[r.sku] += r.qty
        elif r.indeterminate:
            unanswered[r.sku] += r.qty
    for sku, initial in sorted(history.initial.items()):
        if sku not in history.final:
            report.add("lost-update", f"{sku}: no final stock in the history")
            continue
        final = history.final[sku]
        highest = initial - sold[sku]
        lowest = highest - unanswered[sku]
        if not lowest <= final <= highest:
            what = (
                f"{final - highest} sale(s) answered 200 left no trace in the stock (lost "
                "updates)"
                if final > highest
                else f"the stock went down by {lowest - final} more than the 200s and the "
                "unanswered requests (sales nobody was told of)"
            )
            expected = (
                str(highest) if lowest == highest else f"{lowest}..{highest}"
            )
            report.add(
                "lost-update",
                f"{sku}: initial {initial}, {sold[sku]} sold (200), {unanswered[sku]} without an "
                f"answer, final {final}, expected {expected}: {what}",
            )


def check_journal(history: History, report: Report) -> None:
    by_id = {r.id: r for r in history.requests}
    entries_of: dict[str, list[Entry]] = collections.defaultdict(list)
    per_sku: dict[str, list[Entry]] = collections.defaultdict(list)
    for e in history.journal:
        per_sku[e.sku].append(e)
        if e.request is not None:
            entries_of[e.request].append(e)
    report.counts["accepted writes"] = sum(1 for e in history.journal if not e.reset)

    # token-order and the chain of stocks, per SKU.
    for sku, entries in sorted(per_sku.items()):
        last_token_entry: Entry | None = None
        previous: Entry | None = None
        # The last entry that left each stock value, to name what a stale write overwrote.
        wrote_stock: dict[int, int] = {}
        for position, e in enumerate(entries):
            if e.reset:
                previous = e
                wrote_stock[e.stock] = position
                continue
            if e.token is None:
                report.counts["writes without a token"] += 1
            else:
                if last_token_entry is not None and e.token <= last_token_entry.token:
                    report.add(
                        "token-order",
                        f"{sku}: write of {describe_entry(e, by_id)} was accepted after write "
                        f"of {describe_entry(last_token_entry, by_id)}: tokens must strictly "
                        "increase",
                        requests_of([e, last_token_entry], by_id),
                    )
                last_token_entry = e
            if previous is None:
                report.add(
                    "lost-update",
                    f"{sku}: write of {describe_entry(e, by_id)} comes before any stock was set",
                    requests_of([e], by_id),
                )
            else:
                qty = by_id[e.request].qty if e.request in by_id else 1
                expected = previous.stock - qty
                if e.stock != expected:
                    read = e.stock + qty
                    since = wrote_stock.get(read)
                    overwritten = (
                        [x for x in entries[since + 1 : position] if not x.reset]
                        if since is not None
                        else []
                    )
                    named = ", ".join(describe_entry(x, by_id) for x in overwritten[:8])
                    more = f" and {len(overwritten) - 8} more" if len(overwritten) > 8 else ""
                    report.add(
                        "lost-update",
                        f"{sku}: write of {describe_entry(e, by_id)} set the stock to {e.stock} "
                        f"over {previous.stock} (it read {read})"
                        + (f"; it overwrote {named}{more}" if overwritten else ""),
                        requests_of([e, *overwritten], by_id),
                    )
            previous = e
            wrote_stock[e.stock] = position
        final = history.final.get(sku)
        if previous is not None and final is not None and final != previous.stock:
            report.add(
                "lost-update",
                f"{sku}: the final stock is {final}, the last accepted write left "
                f"{previous.stock}: a write the journal does not show",
            )

    # ack-write: each 200 is exactly one accepted write with its token, and each accepted
    # write's request was told 200.
    for r in history.requests:
        mine = [e for e in entries_of.get(r.id, []) if not e.reset and e.sku == r.sku]
        if r.status == 200:
            if not mine:
                report.add(
                    "ack-write",
                    f"answered 200, but the data accepted no write of it: {r.brief()}",
                    [r],
                )
            elif len(mine) > 1:
                report.add(
                    "ack-write",
                    f"answered 200, and the data accepted {len(mine)} writes of it: {r.brief()}",
                    [r],
                )
            elif r.token is not None and mine[0].token != r.token:
                report.add(
                    "ack-write",
                    f"answered 200 with token {r.token}, but its accepted write carries token "
                    f"{mine[0].token}: {r.brief()}",
                    [r],
                )
        elif mine:
            if r.indeterminate:
                report.counts["accepted writes without an answer"] += len(mine)
            else:
                report.add(
                    "ack-write",
                    f"answered {r.status}"
                    + (f" ({r.problem})" if r.problem else "")
                    + f", but the data accepted its write (token {mine[0].token}): {r.brief()}",
                    [r],
                )
    for e in history.journal:
        if e.reset:
            continue
        if e.request is None or e.request not in by_id:
            report.add(
                "ack-write",
                f"{e.sku}: accepted write {describe_entry(e, by_id)} of a request the history "
                "does not know",
            )
    if report.counts["accepted writes without an answer"]:
        report.notes.append(
            f"{report.counts['accepted writes without an answer']} accepted write(s) of requests "
            "that got no answer (their instance was killed or cut off): indeterminate, as a "
            "client sees them"
        )


def describe_entry(e: Entry, by_id: dict[str, Request]) -> str:
    who = e.request if e.request is not None else "(no request id)"
    r = by_id.get(e.request) if e.request is not None else None
    status = "" if r is None else f", answered {r.status if r.status is not None else r.error}"
    return f"#{e.index} {who} (token {e.token}, stock {e.stock}, on {e.instance}{status})"


def requests_of(entries: Iterable[Entry], by_id: dict[str, Request]) -> list[Request]:
    return [by_id[e.request] for e in entries if e.request in by_id]


def serializable(first: Request, then: Request) -> bool:
    """Whether `first` can have held the SKU, for at least its work, and let go before `then`
    took it for at least its own work, each within its request's interval."""
    return max(first.invoke + first.work_ms / 1000, then.invoke) + then.work_ms / 1000 <= (
        then.complete + EPS
    )


def check_overlaps(history: History, report: Report) -> None:
    per_sku: dict[str, list[Request]] = collections.defaultdict(list)
    for r in history.requests:
        if r.status == 200 and r.complete is not None:
            per_sku[r.sku].append(r)
    explained = 0
    for sku, oks in sorted(per_sku.items()):
        oks.sort(key=lambda r: r.invoke)
        invokes = [r.invoke for r in oks]
        for i, a in enumerate(oks):
            # Only requests invoked before `a` completed can overlap it.
            stop = bisect.bisect_right(invokes, a.complete, lo=i + 1)
            for b in oks[i + 1 : stop]:
                if a.token is not None and b.token is not None:
                    older, newer = (a, b) if a.token < b.token else (b, a)
                    if serializable(older, newer):
                        continue
                    suspects = [older]
                else:
                    if serializable(a, b) or serializable(b, a):
                        continue
                    older, newer = a, b
                    suspects = [a, b]
                evidence = [
                    f
                    for s in suspects
                    for f in history.faults
                    if f.kind in LEASE_ENDING_FAULTS
                    and f.hits(s.instance)
                    and f.overlaps(s.invoke, s.complete)
                ]
                if evidence:
                    explained += 1
                    if explained <= 20:
                        report.notes.append(
                            f"{sku}: {older.brief()} and {newer.brief()} held the SKU at once; "
                            f"the older lost its lease to {evidence[0].brief()}"
                        )
                    continue
                report.add(
                    "overlap",
                    f"{sku}: {older.brief()} and {newer.brief()} both answered 200 and cannot "
                    "have held the SKU one after the other, with no fault to show a lost lease",
                    [older, newer],
                )
    report.counts["overlaps explained by a lost lease"] = explained
    if explained > 20:
        report.notes.append(f"... {explained - 20} more overlaps explained by a lost lease")


def check_recovery(history: History, report: Report, slack: float) -> None:
    window = history.ttl + slack
    by_invoke = sorted(history.requests, key=lambda r: r.invoke)
    invokes = [r.invoke for r in by_invoke]
    skus = sorted(history.initial)
    for f in history.faults:
        if f.end is None:
            report.add("recovery", f"{f.brief()} never healed", faults=[f])
            continue
        later = [g for g in history.faults if g.id != f.id and f.end < g.start < f.end + window]
        if later:
            report.notes.append(
                f"recovery after {f.brief()} not judged: {later[0].brief()} started within "
                f"{window:.1f} s"
            )
            continue
        if history.end is not None and history.end < f.end + window:
            report.notes.append(f"recovery after {f.brief()} not judged: the run ended first")
            continue
        lo = bisect.bisect_left(invokes, f.end)
        hi = bisect.bisect_right(invokes, f.end + window)
        asked = by_invoke[lo:hi]
        first_sku: dict[str, float] = {}
        first_instance: dict[str, float] = {}
        for r in asked:
            if r.status in ACQUIRED and r.complete is not None and r.complete <= f.end + window:
                first_sku[r.sku] = min(first_sku.get(r.sku, math.inf), r.complete)
                first_instance[r.instance] = min(
                    first_instance.get(r.instance, math.inf), r.complete
                )
        missing = [s for s in skus if s not in first_sku]
        instances = sorted({r.instance for r in asked})
        missing_instances = [i for i in instances if i not in first_instance]
        if missing or missing_instances:
            stuck = [r for r in asked if r.sku in missing or r.instance in missing_instances]
            what = []
            if missing:
                what.append("SKU(s) " + ", ".join(missing))
            if missing_instances:
                what.append("instance(s) " + ", ".join(missing_instances))
            statuses = collections.Counter(
                str(r.status) if r.status is not None else (r.error or "no answer") for r in stuck
            )
            report.add(
                "recovery",
                f"after {f.brief()} healed, {' and '.join(what)} sold nothing within "
                f"{window:.1f} s (TTL + {slack} s): {len(stuck)} requests, answers "
                f"{dict(statuses)}",
                stuck[:5],
                [f],
            )
            report.recovery[f.id] = None
        else:
            report.recovery[f.id] = max(first_sku.values()) - f.end


# -------------------------------------------------------------------------------------------
# Figures


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(p * len(values)) - 1))]


def figures(
    history: History, report: Report, recovery_slack: float = RECOVERY_SLACK
) -> list[dict]:
    """One row per fault kind: requests in flight while the fault lasted, their answers,
    violations, p99 latency, time to recover; and one row, "none", for the requests that
    neither a fault nor the recovery from one (TTL + `recovery_slack` after it) touched."""
    end_of_run = history.end if history.end is not None else math.inf
    by_invoke = sorted(history.requests, key=lambda r: r.invoke)
    invokes = [r.invoke for r in by_invoke]
    longest = max(
        ((r.complete if r.complete is not None else end_of_run) - r.invoke for r in by_invoke),
        default=0.0,
    )
    by_kind: dict[str, list[Fault]] = collections.defaultdict(list)
    for f in history.faults:
        by_kind[f.kind].append(f)
    rows = []
    touched: set[str] = set()
    for kind in sorted(by_kind):
        faults = by_kind[kind]
        ids: set[str] = set()
        during = []
        for f in faults:
            f_end = f.end if f.end is not None else end_of_run
            healed = f_end + history.ttl + recovery_slack
            lo = bisect.bisect_left(invokes, f.start - longest)
            hi = bisect.bisect_right(invokes, healed)
            for r in by_invoke[lo:hi]:
                complete = r.complete if r.complete is not None else end_of_run
                if r.id not in ids and f.overlaps(r.invoke, complete):
                    ids.add(r.id)
                    during.append(r)
                elif r.invoke <= healed and complete >= f.start:
                    touched.add(r.id)
        touched |= ids
        fault_ids = {f.id for f in faults}
        violations = sum(
            1
            for v in report.violations
            if ids.intersection(v.requests) or fault_ids.intersection(v.faults)
        )
        recoveries = [
            report.recovery[f.id] for f in faults if report.recovery.get(f.id) is not None
        ]
        rows.append(row(kind, len(faults), during, violations, recoveries))
    rest = [r for r in history.requests if r.id not in touched]
    rest_ids = {r.id for r in rest}
    violations = sum(1 for v in report.violations if rest_ids.intersection(v.requests))
    rows.append(row("none", 0, rest, violations, []))
    return rows


def row(
    kind: str, times: int, requests: list[Request], violations: int, recoveries: list[float]
) -> dict:
    answers = collections.Counter(
        str(r.status) if r.status is not None else ("no answer" if r.complete is None else "conn")
        for r in requests
    )
    latencies = [r.latency for r in requests if r.latency is not None]
    return {
        "fault": kind,
        "times": times,
        "requests": len(requests),
        "answers": dict(sorted(answers.items())),
        "violations": violations,
        "p99_ms": None if not latencies else round(percentile(latencies, 0.99) * 1000),
        "recover_max_ms": None if not recoveries else round(max(recoveries) * 1000),
        "recover_median_ms": (
            None if not recoveries else round(statistics.median(recoveries) * 1000)
        ),
    }


def figures_table(rows: list[dict]) -> str:
    lines = [
        "| fault | times | requests in flight | 200 | 409 | 422 | 503 | other / no answer | "
        "violations | p99 latency | time to recover (median, max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r["answers"]
        other = sum(v for k, v in a.items() if k not in ("200", "409", "422", "503"))
        recover = (
            "–"
            if r["recover_max_ms"] is None
            else f"{r['recover_median_ms']} ms, {r['recover_max_ms']} ms"
        )
        p99 = "–" if r["p99_ms"] is None else f"{r['p99_ms']} ms"
        lines.append(
            f"| {r['fault']} | {r['times']} | {r['requests']:,} | {a.get('200', 0):,} | "
            f"{a.get('409', 0):,} | {a.get('422', 0):,} | {a.get('503', 0):,} | {other:,} | "
            f"{r['violations']} | {p99} | {recover} |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("history", help="the run's history, JSON lines")
    parser.add_argument("--answer-slack", type=float, default=ANSWER_SLACK, metavar="S")
    parser.add_argument("--recovery-slack", type=float, default=RECOVERY_SLACK, metavar="S")
    parser.add_argument("--figures", action="store_true", help="print the table per fault")
    parser.add_argument("--summary", metavar="FILE", help="write the verdict as JSON")
    parser.add_argument(
        "--max-printed", type=int, default=30, help="violations printed per rule (default 30)"
    )
    args = parser.parse_args(argv)
    try:
        with open(args.history, encoding="utf-8") as f:
            history = read_history(f)
    except (OSError, HistoryError) as e:
        print(f"check: cannot read {args.history}: {e}", file=sys.stderr)
        return 2
    report = check(history, args.answer_slack, args.recovery_slack)
    label = history.run.get("label", "run")
    printed = collections.Counter()
    for v in report.violations:
        printed[v.rule] += 1
        if printed[v.rule] <= args.max_printed:
            print(f"VIOLATION {v.rule}: {v.text}")
    for rule, n in sorted(printed.items()):
        if n > args.max_printed:
            print(f"... {n - args.max_printed} more {rule} violations")
    for note in report.notes:
        print(f"note: {note}")
    rows = figures(history, report, args.recovery_slack)
    if args.figures:
        print(figures_table(rows))
    counts = dict(report.counts)
    verdict = "FAIL" if report.violations else "PASS"
    print(
        f"{verdict} {label}: {counts.get('requests', 0)} requests, {counts.get('200', 0)} sold, "
        f"{len(report.violations)} violations {report.by_rule() or ''} "
        f"(slack: answers {args.answer_slack} s, recovery TTL + {args.recovery_slack} s)"
    )
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "label": label,
                    "passed": not report.violations,
                    "violations": report.by_rule(),
                    "counts": counts,
                    "journal": history.journal is not None,
                    "figures": rows,
                    "slack": {"answer_s": args.answer_slack, "recovery_s": args.recovery_slack},
                },
                f,
                indent=1,
            )
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
