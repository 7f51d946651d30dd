"""scripts/e2e.d/upgrade-attribute: what it lets through as the previous release's doing,
and what it refuses (tests/scripts.rs runs these with `python3 -m unittest`)."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "e2e.d" / "upgrade-attribute"
JOB = "c8de1dfa-9dfa-46df-bbc5-0e30141da5da"
OTHER = "8acad731-1652-4d34-81a0-08393cfae051"
# 2026-12-07T11:36:30Z and 11:36:40Z: the one window of these cases.
START, END = 1796643390.0, 1796643400.0


def colored(stamp, level, message):
    """A line as tracing writes it to a file with colours on (0.2.0's demo-run does)."""
    return f"\x1b[2m{stamp}\x1b[0m \x1b[33m {level}\x1b[0m \x1b[2mprism_operator::commands::demo_run\x1b[0m\x1b[2m:\x1b[0m {message}\n"


class Attribute(unittest.TestCase):
    def run_it(self, retried=(), log="", events="", failures=()):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            (d / "w").write_text(f"{START} {END} 0.2.0 stopped by the first upgrade\n")
            (d / "load.json").write_text(json.dumps({"retried_samples": list(retried), "stream_errors": [],
                                                          "failures": list(failures)}))
            (d / "events").write_text(events)
            (d / "run.log").write_text(log)
            out = subprocess.run(
                [sys.executable, str(SCRIPT), "--windows", str(d / "w"), "--load", str(d / "load.json"),
                 "--events", str(d / "events"), str(d / "run.log")],
                capture_output=True, text=True, check=False)
            return out.returncode, out.stdout.strip(), out.stderr

    def test_a_retry_and_a_given_up_ack_in_the_window_are_the_previous_release(self):
        log = colored("2026-12-07T11:36:33.100000Z", "WARN",
                      f"ack failed; the job returns to the queue at its visibility timeout job={JOB} error=HTTP")
        events = f"{JOB}|claimed|1|{START + 2}\n{JOB}|queued|1|{START + 40}\n{JOB}|claimed|2|{START + 41}\n"
        code, out, err = self.run_it([{"kind": "http.heartbeat", "t": 3.0, "at": START + 1}], log, events)
        self.assertEqual((code, out), (0, "1 0"), err)
        self.assertIn("the Run gave up its ack", err)

    def test_a_claim_answer_lost_in_the_window_is_the_previous_release(self):
        events = f"{OTHER}|claimed|1|{START + 5}\n{OTHER}|queued|1|{START + 40}\n{OTHER}|claimed|2|{START + 41}\n"
        code, out, err = self.run_it(events=events)
        self.assertEqual((code, out), (0, "1 0"), err)

    def test_a_retry_outside_every_window_is_refused(self):
        code, _, err = self.run_it([{"kind": "mcp.heartbeat", "t": 90.0, "at": END + 30,
                                     "first_try": "ConnectError"}])
        self.assertEqual(code, 1, err)
        self.assertIn("mcp.heartbeat retried", err)

    def test_a_second_attempt_with_nothing_to_explain_it_is_refused(self):
        # Acknowledged at its first attempt, then claimed again: nothing cut it off.
        events = (f"{JOB}|claimed|1|{START + 2}\n{JOB}|running|1|{START + 2.1}\n"
                  f"{JOB}|queued|1|{START + 40}\n{JOB}|claimed|2|{START + 41}\n")
        code, out, err = self.run_it(events=events)
        self.assertEqual((code, out), (1, "0 0"), err)
        self.assertIn(f"job {JOB} ran again", err)

    def test_a_call_that_twice_could_not_connect_in_the_window_is_the_previous_release(self):
        refused = {"kind": "http.heartbeat", "t": 7.0, "at": START + 3, "status": None,
                   "first_try": "ConnectError: ConnectError('')", "error": "ConnectError: ConnectError('')"}
        code, out, err = self.run_it(failures=[refused])
        self.assertEqual((code, out), (0, "0 1"), err)
        self.assertIn("failed twice to connect", err)
        # Outside the windows, or answered, or cut after connecting: not excused.
        for f in ({**refused, "at": END + 30}, {**refused, "status": 500},
                  {**refused, "error": "ReadTimeout: ReadTimeout('')"}):
            code, out, err = self.run_it(failures=[f])
            self.assertEqual(out, "0 0", f"{f}: {err}")

    def test_a_step_given_up_outside_the_windows_or_a_lost_session_is_refused(self):
        log = colored("2026-12-07T11:40:00.000000Z", "WARN", f"complete failed job={JOB} error=HTTP")
        log += colored("2026-12-07T11:36:35.000000Z", "WARN", "session lost; saying hello again error=expired")
        code, _, err = self.run_it(log=log)
        self.assertEqual(code, 1, err)
        self.assertIn("complete failed outside", err)
        self.assertIn("lost its session", err)

    def test_a_session_lost_after_a_call_failed_in_a_stop_is_the_previous_release(self):
        # 11:36:35 is in the window; the loss 25 s later, its lease unrenewed since.
        log = colored("2026-12-07T11:36:35.000000Z", "WARN",
                      "claim failed; retrying error=HTTP: error sending request for url (https://x/claim)")
        log += colored("2026-12-07T11:37:00.000000Z", "WARN", "session lost; saying hello again error=expired")
        code, out, err = self.run_it(log=log)
        self.assertEqual((code, out), (0, "0 0"), err)
        self.assertIn("lost session, the previous release's doing", err)
        # A claim that began in the window may fail up to 40 s after it (0.2.0's claim timeout).
        log = colored("2026-12-07T11:37:15.000000Z", "WARN", "heartbeat failed; retrying error=HTTP: timed out")
        log += colored("2026-12-07T11:37:16.000000Z", "WARN", "session lost; saying hello again error=expired")
        code, out, err = self.run_it(log=log)
        self.assertEqual(code, 0, err)

    def test_a_session_lost_with_no_failure_in_a_stop_before_it_is_refused(self):
        # The only failure: 60 s after the window, beyond any call begun in it.
        log = colored("2026-12-07T11:37:40.000000Z", "WARN", "claim failed; retrying error=HTTP: reset")
        log += colored("2026-12-07T11:37:50.000000Z", "WARN", "session lost; saying hello again error=expired")
        code, _, err = self.run_it(log=log)
        self.assertEqual(code, 1, err)
        self.assertIn("with no call failed in a stop", err)
        self.assertIn("11:37:40.000Z claim failed", err, "the Run's failures around it are shown")
        # A failure in the window, but longer than the lease before the loss.
        log = colored("2026-12-07T11:36:35.000000Z", "WARN", "claim failed; retrying error=HTTP: reset")
        log += colored("2026-12-07T11:37:20.000000Z", "WARN", "session lost; saying hello again error=expired")
        code, _, err = self.run_it(log=log)
        self.assertEqual(code, 1, err)


if __name__ == "__main__":
    unittest.main()
