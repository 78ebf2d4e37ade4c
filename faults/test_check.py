"""Unit tests of the history checker on small hand-made histories: each rule caught, each
clean history passed.

    python3 -m unittest discover -s faults -p 'test_*.py'
"""

from __future__ import annotations

import ast
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import check  # noqa: E402

TTL_MS = 1000


class Builder:
    """A history, line by line, in the format the harness writes."""

    def __init__(self, skus=("a",), stock=10, journal=True):
        self.lines = [
            {
                "type": "run",
                "label": "test",
                "ttl_ms": TTL_MS,
                "wait_ms": 1000,
                "instances": ["i1", "i2"],
                "skus": list(skus),
            }
        ]
        self.stock = {}
        self.entries = []
        self.journal = journal
        self.fault_ids = 0
        self.request_ids = 0
        for sku in skus:
            self.lines.append({"type": "stock", "sku": sku, "stock": stock, "t": 0.0})
            self.stock[sku] = stock
            self.entry(sku, 0, stock, None, f"reset-{sku}", reset=True)

    def entry(self, sku, token, stock, instance, request, reset=False):
        e = {"sku": sku, "token": token, "stock": stock, "instance": instance, "request": request}
        if reset:
            e["reset"] = True
        self.entries.append(e)

    def request(
        self,
        invoke,
        complete,
        status=200,
        sku="a",
        instance="i1",
        token=None,
        work_ms=0,
        deadline_ms=3000,
        write=None,
        error=None,
    ):
        """A purchase; a 200 writes the stock down by one unless `write` says otherwise
        (False: no write; an int: the stock it wrote)."""
        self.request_ids += 1
        rid = f"r{self.request_ids}"
        stock = None
        if write is True or (status == 200 and write is None):
            write = self.stock[sku] - 1
        if write is not None and write is not False:
            stock = write
            self.stock[sku] = stock
            self.entry(sku, token, stock, instance, rid)
        self.lines.append(
            {
                "type": "request",
                "id": rid,
                "op": "purchase",
                "sku": sku,
                "instance": instance,
                "invoke": invoke,
                "complete": complete,
                "status": status,
                "token": token if status == 200 else None,
                "stock": stock if status == 200 else None,
                "work_ms": work_ms,
                "deadline_ms": deadline_ms,
                "error": error,
            }
        )
        return rid

    def sell_after(self, t, token):
        """A sale of every SKU on i2 just after `t` (a fault's heal), so that it recovered."""
        for i, sku in enumerate(self.stock):
            self.request(t + 0.01, t + 0.02, sku=sku, instance="i2", token=token + i)

    def fault(self, kind, start, end, target="i1"):
        self.fault_ids += 1
        self.lines.append(
            {"type": "fault", "id": self.fault_ids, "kind": kind, "phase": "start", "t": start,
             "target": target}
        )
        if end is not None:
            self.lines.append(
                {"type": "fault", "id": self.fault_ids, "kind": kind, "phase": "end", "t": end}
            )
        return self.fault_ids

    def history(self, final=None, end=None):
        lines = list(self.lines)
        if self.journal:
            for i, e in enumerate(self.entries):
                lines.append({"type": "journal", "index": i, "entry": e})
            lines.append({"type": "journal_end", "available": True, "entries": len(self.entries)})
        for sku, stock in (final or self.stock).items():
            lines.append({"type": "final", "sku": sku, "stock": stock})
        if end is None:
            end = max([l.get("complete") or 0 for l in lines if l["type"] == "request"] + [0]) + 10
        lines.append({"type": "end", "t": end})
        return check.read_history(json.dumps(l) for l in lines)


def rules(report):
    return sorted({v.rule for v in report.violations})


class CleanHistories(unittest.TestCase):
    def test_serial_sales_pass(self):
        h = Builder()
        h.request(0.0, 0.1, token=1, work_ms=50)
        h.request(0.05, 0.2, token=2, work_ms=50)  # waited for the first
        h.request(0.3, 0.4, status=409)
        report = check.check(h.history())
        self.assertEqual(report.violations, [])
        self.assertEqual(report.counts["accepted writes"], 2)

    def test_without_a_journal_the_counts_are_checked_and_a_note_says_so(self):
        h = Builder(journal=False)
        h.request(0.0, 0.1, token=1)
        report = check.check(h.history())
        self.assertEqual(report.violations, [])
        self.assertTrue(any("no write journal" in n for n in report.notes))

    def test_a_fault_that_heals_and_is_followed_by_sales_passes(self):
        h = Builder(skus=("a", "b"))
        h.fault("partition", 1.0, 3.0, target="i1")
        h.request(1.5, 2.6, status=503, instance="i1")
        h.request(3.2, 3.3, token=5, sku="a", instance="i1")
        h.request(3.3, 3.5, token=6, sku="b", instance="i2")
        report = check.check(h.history())
        self.assertEqual(report.violations, [])
        self.assertAlmostEqual(report.recovery[1], 0.5)

    def test_a_write_whose_request_got_no_answer_is_indeterminate(self):
        h = Builder()
        h.fault("kill", 1.0, 1.5, target="i1")
        h.request(0.9, 1.0, status=None, token=3, error="connection reset", write=True)
        h.request(2.0, 2.1, token=4, instance="i2")
        report = check.check(h.history())
        self.assertEqual(report.violations, [])
        self.assertEqual(report.counts["accepted writes without an answer"], 1)


class EachRuleIsCaught(unittest.TestCase):
    def test_token_order(self):
        h = Builder()
        h.request(0.0, 0.1, token=5)
        h.request(0.2, 0.3, token=4)
        report = check.check(h.history())
        self.assertEqual(rules(report), ["token-order"])
        self.assertIn("r2", report.violations[0].requests)

    def test_equal_tokens_are_out_of_order(self):
        h = Builder()
        h.request(0.0, 0.1, token=5)
        h.request(0.2, 0.3, token=5)
        self.assertIn("token-order", rules(check.check(h.history())))

    def test_a_stale_write_is_a_lost_update_naming_what_it_overwrote(self):
        h = Builder(stock=10)
        # r1 read 10 and was paused; r2 and r3 sold meanwhile; r1 wrote 9 over 8.
        h.fault("pause", 0.1, 3.0, target="i1")
        h.request(0.2, 0.3, token=2, instance="i2")  # 9
        h.request(0.4, 0.5, token=3, instance="i2")  # 8
        h.request(0.0, 3.1, token=1, instance="i1", work_ms=100, write=9)
        report = check.check(h.history())
        self.assertIn("lost-update", rules(report))
        self.assertIn("token-order", rules(report))
        lost = [v for v in report.violations if v.rule == "lost-update"]
        self.assertTrue(any("r1" in v.requests and "r2" in v.requests and "r3" in v.requests
                            for v in lost), lost)
        # Three 200s, the stock went down by 1.
        self.assertTrue(any("expected 7" in v.text for v in lost), lost)

    def test_final_stock_not_the_last_write(self):
        h = Builder(stock=10)
        h.request(0.0, 0.1, token=1)
        report = check.check(h.history(final={"a": 5}))
        self.assertEqual(rules(report), ["lost-update"])
        self.assertTrue(any("last accepted write left 9" in v.text for v in report.violations))

    def test_lost_update_without_a_journal(self):
        h = Builder(stock=10, journal=False)
        h.request(0.0, 0.1, token=1)
        h.request(0.0, 0.1, token=2)
        report = check.check(h.history(final={"a": 9}))
        self.assertEqual(rules(report), ["lost-update"])

    def test_a_200_without_an_accepted_write(self):
        h = Builder()
        h.request(0.0, 0.1, token=1, write=False)
        report = check.check(h.history(final={"a": 10}))
        self.assertIn("ack-write", rules(report))

    def test_a_write_that_landed_for_a_request_told_503(self):
        h = Builder()
        h.request(0.0, 0.1, status=503, token=1, write=True)
        report = check.check(h.history())
        self.assertIn("ack-write", rules(report))

    def test_a_200_whose_write_has_another_token(self):
        h = Builder()
        rid = h.request(0.0, 0.1, token=7)
        h.entries[-1]["token"] = 8
        report = check.check(h.history())
        self.assertEqual(rules(report), ["ack-write"])
        self.assertEqual(report.violations[0].requests, [rid])

    def test_a_write_of_an_unknown_request(self):
        h = Builder()
        h.entry("a", 3, 9, "i1", "nobody")
        h.stock["a"] = 9
        self.assertEqual(rules(check.check(h.history())), ["ack-write", "lost-update"])

    def test_a_proven_overlap_without_a_fault(self):
        h = Builder()
        # Both worked 100 ms inside 120 ms windows that overlap by 100 ms: they cannot have
        # taken turns.
        h.request(0.0, 0.12, token=1, work_ms=100)
        h.request(0.02, 0.14, token=2, work_ms=100)
        report = check.check(h.history())
        self.assertEqual(rules(report), ["overlap"])
        self.assertEqual(report.violations[0].requests, ["r1", "r2"])

    def test_an_overlap_in_client_time_that_can_be_serial_passes(self):
        h = Builder()
        h.request(0.0, 0.12, token=1, work_ms=50)
        h.request(0.01, 0.2, token=2, work_ms=50)
        self.assertEqual(check.check(h.history()).violations, [])

    def test_the_token_order_decides_who_went_first(self):
        h = Builder()
        # Serial the other way round would fit (r2's work, then r1's), but r1's token is older.
        h.request(0.0, 0.3, token=1, work_ms=250)
        h.request(0.1, 0.2, token=2, work_ms=50)
        self.assertEqual(rules(check.check(h.history())), ["overlap"])

    def test_an_overlap_explained_by_a_pause_is_reported_not_counted(self):
        h = Builder()
        h.fault("pause", 0.05, 2.0, target="i1")
        h.request(0.0, 2.1, token=1, work_ms=2000, instance="i1")
        h.request(1.2, 1.3, token=2, work_ms=50, instance="i2")
        h.sell_after(2.1, token=3)
        report = check.check(h.history())
        self.assertEqual(report.violations, [])
        self.assertEqual(report.counts["overlaps explained by a lost lease"], 1)

    def test_a_fault_on_the_newer_holder_explains_nothing(self):
        h = Builder()
        h.fault("pause", 1.15, 1.25, target="i2")
        h.request(0.0, 2.1, token=1, work_ms=2000, instance="i1")
        h.request(1.2, 1.3, token=2, work_ms=50, instance="i2", deadline_ms=3000)
        h.sell_after(2.1, token=3)
        self.assertEqual(rules(check.check(h.history())), ["overlap"])

    def test_without_tokens_an_overlap_needs_both_orders_impossible(self):
        h = Builder()
        h.request(0.0, 0.12, work_ms=100)
        h.request(0.02, 0.14, work_ms=100)
        self.assertEqual(rules(check.check(h.history())), ["overlap"])

    def test_late_answer(self):
        h = Builder()
        h.request(0.0, 5.0, status=409, deadline_ms=2000)
        report = check.check(h.history())
        self.assertEqual(rules(report), ["deadline"])

    def test_a_pause_of_the_instance_extends_the_deadline(self):
        h = Builder()
        h.fault("pause", 0.5, 3.5, target="i1")
        h.request(0.0, 4.0, status=409, deadline_ms=2000, instance="i1")
        h.sell_after(3.5, token=1)
        self.assertEqual(check.check(h.history()).violations, [])

    def test_a_pause_of_another_instance_does_not(self):
        h = Builder()
        h.fault("pause", 0.5, 3.5, target="i2")
        h.request(0.0, 4.0, status=409, deadline_ms=2000, instance="i1")
        h.sell_after(3.5, token=1)
        self.assertEqual(rules(check.check(h.history())), ["deadline"])

    def test_no_answer(self):
        h = Builder()
        h.request(0.0, None, status=None, error="timeout")
        self.assertEqual(rules(check.check(h.history())), ["deadline"])

    def test_no_sale_after_a_fault_heals(self):
        h = Builder(skus=("a", "b"))
        h.fault("redis-restart", 1.0, 2.0, target="lock-store")
        h.request(2.1, 2.2, token=3, sku="a")
        h.request(2.1, 3.1, status=409, sku="b")
        report = check.check(h.history())
        self.assertEqual(rules(report), ["recovery"])
        self.assertIn("SKU(s) b", report.violations[0].text)
        self.assertIsNone(report.recovery[1])

    def test_a_sale_after_the_window_is_too_late(self):
        h = Builder()
        h.fault("partition", 1.0, 2.0)
        h.request(2.1, 5.5, token=3, deadline_ms=5000)  # completes 3.5 s after the heal
        self.assertEqual(rules(check.check(h.history())), ["recovery"])

    def test_an_instance_that_never_sells_again(self):
        h = Builder()
        h.fault("partition", 1.0, 2.0, target="i1")
        h.request(2.1, 2.2, token=3, instance="i2")
        h.request(2.1, 3.1, status=503, instance="i1")
        report = check.check(h.history())
        self.assertEqual(rules(report), ["recovery"])
        self.assertIn("instance(s) i1", report.violations[0].text)

    def test_a_fault_that_never_heals(self):
        h = Builder()
        h.fault("partition", 1.0, None)
        self.assertEqual(rules(check.check(h.history())), ["recovery"])

    def test_recovery_is_not_judged_when_the_next_fault_comes_first(self):
        h = Builder()
        h.fault("partition", 1.0, 2.0)
        h.fault("pause", 2.5, 3.0)
        h.request(3.1, 3.2, token=3)
        report = check.check(h.history())
        self.assertEqual(report.violations, [])
        self.assertTrue(any("not judged" in n for n in report.notes))

    def test_unexpected_status(self):
        h = Builder()
        h.request(0.0, 0.1, status=500)
        self.assertEqual(rules(check.check(h.history())), ["status"])


class Reading(unittest.TestCase):
    def test_a_history_without_a_run_record_is_refused(self):
        with self.assertRaises(check.HistoryError):
            check.read_history(['{"type": "final", "sku": "a", "stock": 1}'])

    def test_a_malformed_line_names_its_number(self):
        with self.assertRaisesRegex(check.HistoryError, "line 2"):
            check.read_history(['{"type": "run", "ttl_ms": 1000}', "{not json"])

    def test_the_command_line_exit_status(self):
        clean, broken = Builder(), Builder()
        clean.request(0.0, 0.1, token=1)
        broken.request(0.0, 0.1, token=1, write=False)
        with tempfile.TemporaryDirectory() as d:
            for name, b, status in (("clean", clean, 0), ("broken", broken, 1)):
                path = os.path.join(d, name + ".jsonl")
                with open(path, "w") as f:
                    final = b.stock if name == "clean" else {"a": 10}
                    b.history()  # the lines are complete once history() ran
                    for line in b.lines:
                        f.write(json.dumps(line) + "\n")
                    for i, e in enumerate(b.entries):
                        f.write(json.dumps({"type": "journal", "index": i, "entry": e}) + "\n")
                    f.write(json.dumps({"type": "journal_end", "available": True}) + "\n")
                    for sku, stock in final.items():
                        f.write(json.dumps({"type": "final", "sku": sku, "stock": stock}) + "\n")
                summary = os.path.join(d, name + ".json")
                out = io.StringIO()
                with redirect_stdout(out):
                    code = check.main([path, "--figures", "--summary", summary])
                self.assertEqual(code, status, out.getvalue())
                with open(summary) as f:
                    self.assertEqual(json.load(f)["passed"], status == 0)
                self.assertIn("| fault |", out.getvalue())
            self.assertEqual(check.main([os.path.join(d, "missing.jsonl")]), 2)


class Figures(unittest.TestCase):
    def test_a_row_per_fault_kind_and_one_without_faults(self):
        h = Builder()
        h.fault("pause", 1.0, 2.0, target="i1")
        h.request(0.5, 2.5, status=409, instance="i1")
        h.request(1.5, 1.6, token=1, instance="i2")
        h.request(2.2, 2.3, token=2, instance="i2")  # recovering: in neither row
        h.request(9.0, 9.1, token=3, instance="i2")
        history = h.history()
        report = check.check(history)
        rows = {r["fault"]: r for r in check.figures(history, report)}
        self.assertEqual(rows["pause"]["requests"], 2)
        self.assertEqual(rows["pause"]["answers"], {"200": 1, "409": 1})
        self.assertEqual(rows["pause"]["recover_max_ms"], 300)
        self.assertEqual(rows["none"]["requests"], 1)


class Independence(unittest.TestCase):
    def test_the_checker_imports_only_the_standard_library(self):
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check.py")
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add((node.module or "").split(".")[0])
        self.assertEqual(imported - set(sys.stdlib_module_names), set())


if __name__ == "__main__":
    unittest.main()
