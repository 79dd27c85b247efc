"""Test waits stretch with the machine's load (sgl_kvxfer/testing/servers.py): a wait that only
passes on an idle machine is a wait on the wrong clock."""
import os
import time

from sgl_kvxfer.testing import servers


def test_timeouts_stretch_with_the_load_per_core(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert servers.load_factor() == 1.0 and servers.scaled(120) == 120
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0 * cores, 3.0 * cores, 1.0))
    assert servers.scaled(120) == 120 * 7.0


def test_a_deadline_stretches_when_the_load_rises_while_waiting(monkeypatch):
    load = [0.0]
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    deadline = servers.Deadline(0.2)
    time.sleep(0.25)
    load[0] = 10.0 * (os.cpu_count() or 1)  # the machine got busy: 0.2 s become 2 s
    assert not deadline.expired()
    assert "x load 10.0" in str(deadline)
