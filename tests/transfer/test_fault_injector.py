"""The one fault seam: a fault planned for a request strikes its next transfer at that end, once."""

import pytest
import torch

from transfer import ArgInvalid
from transfer.faults import CORRUPT_PAYLOAD, SENDER_ABORT, STALL, FaultInjector


def test_a_planned_fault_is_taken_once_by_the_end_it_strikes():
    faults = FaultInjector()
    buffer = torch.zeros(64, dtype=torch.uint8)
    ranges = torch.tensor([[8, 16]], dtype=torch.int64)
    faults.plan("r", SENDER_ABORT)
    assert faults.receiver_hook("r", buffer, ranges) is None  # not the receiver's fault
    assert faults.sender_hook("other", timeout_s=1.0) is None
    assert faults.sender_hook("r", timeout_s=1.0) is not None
    assert faults.sender_hook("r", timeout_s=1.0) is None  # taken: a retry gets none

    faults.plan("r", CORRUPT_PAYLOAD)
    hook = faults.receiver_hook("r", buffer, ranges)
    hook(None, 0)  # the first chunk landed: the first byte the transfer wrote flips
    assert int(buffer[8]) == 0xFF and int(buffer.sum()) == 0xFF


def test_a_plan_can_be_forgotten_and_only_transfer_faults_are_planned():
    faults = FaultInjector()
    assert faults.plan("r", STALL) is False  # nothing was planned before
    assert faults.plan("r", None) is True  # a plan not taken was dropped
    assert faults.sender_hook("r", timeout_s=1.0) is None
    faults.plan("r", SENDER_ABORT)
    assert faults.sender_hook("r", timeout_s=1.0) is not None
    assert faults.plan("r", None) is False  # its transfer took it: nothing left to drop
    with pytest.raises(ArgInvalid) as refused:
        faults.plan("r", "receiver_cancel")  # the driver's own action, not a transfer's
    assert (refused.value.field, refused.value.value) == ("kind", "receiver_cancel")
