"""The decisions of scripts/control-plane, without starting anything (tests/scripts.rs
runs these with `python3 -m unittest`)."""

import importlib.machinery
import importlib.util
import random
import unittest
from pathlib import Path

_path = Path(__file__).resolve().parent.parent / "control-plane"
_loader = importlib.machinery.SourceFileLoader("control_plane", str(_path))
_spec = importlib.util.spec_from_loader("control_plane", _loader)
cp = importlib.util.module_from_spec(_spec)
_loader.exec_module(cp)


class PortWindow(unittest.TestCase):
    def test_the_window_ends_below_the_ephemeral_range(self):
        self.assertEqual(cp.port_window(32768), (20000, 32000))
        self.assertEqual(cp.port_window(15000), (3000, 15000))

    def test_no_room_below_the_range_is_an_error_that_says_so(self):
        with self.assertRaisesRegex(ValueError, "starts at 1500: no room"):
            cp.port_window(1500)


class PickPorts(unittest.TestCase):
    def test_distinct_free_ports_within_the_window(self):
        taken = set(range(20000, 20500))
        ports = cp.pick_ports(3, (20000, 21000), is_free=lambda p: p not in taken, rng=random.Random(7))
        self.assertEqual(len(set(ports)), 3)
        self.assertTrue(all(20500 <= p < 21000 for p in ports), ports)

    def test_a_full_window_is_an_error_not_a_hang(self):
        with self.assertRaisesRegex(RuntimeError, "no 3 free loopback ports in 20000-20010"):
            cp.pick_ports(3, (20000, 20010), is_free=lambda p: p == 20001, rng=random.Random(1))


class AfterAFailedStart(unittest.TestCase):
    def test_a_port_taken_before_the_bind_is_retried_on_other_ports(self):
        logs = 'listen tcp 127.0.0.1:21345: bind: Address already in use\n'
        self.assertEqual(cp.exit_cause(logs), cp.PORT_TAKEN)
        self.assertEqual(cp.next_step(cp.PORT_TAKEN, 1), "retry")
        self.assertEqual(cp.next_step(cp.PORT_TAKEN, cp.ATTEMPTS - 1), "retry")

    def test_the_last_attempt_and_any_other_failure_give_up(self):
        self.assertEqual(cp.next_step(cp.PORT_TAKEN, cp.ATTEMPTS), "give up")
        self.assertEqual(cp.exit_cause("error: invalid flag --no-such-flag"), cp.FAILED)
        self.assertEqual(cp.next_step(cp.FAILED, 1), "give up")


class Kubeconfig(unittest.TestCase):
    def test_it_names_the_port_and_carries_the_certificates(self):
        text = cp.kubeconfig(24567, b"CA", b"CRT", b"KEY")
        self.assertIn("server: https://127.0.0.1:24567\n", text)
        self.assertIn("certificate-authority-data: Q0E=\n", text)
        self.assertIn("client-certificate-data: Q1JU\n", text)
        self.assertIn("client-key-data: S0VZ\n", text)
        self.assertIn("current-context: prism-test\n", text)


if __name__ == "__main__":
    unittest.main()
