"""A worker's channel activity: model work waits for the ends' io_locks to be let go (an event)."""

import threading

from transfer.ends.activity import Activity, ActivityLock


def test_waiters_wake_when_the_last_end_lets_go_of_its_channel():
    activity = Activity()
    sender_end, receiver_end = ActivityLock(activity), ActivityLock(activity)
    assert not activity.busy() and activity.wait_idle(0)
    sender_end.acquire()
    with receiver_end:
        assert activity.busy() and not activity.wait_idle(0)
        assert sender_end.locked() and receiver_end.locked()
    assert activity.busy() and not activity.wait_idle(0)  # one end still moves bytes
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: activity.wait_idle(60) and woke.set())
    waiter.start()
    sender_end.release()
    waiter.join(30)
    assert woke.is_set()
    assert not activity.busy()


def test_a_lock_without_an_activity_is_a_plain_lock():
    lock = ActivityLock()
    assert lock.acquire(blocking=False)
    assert not lock.acquire(blocking=False)
    lock.release()
    assert not lock.locked()


def test_an_end_waiting_for_its_peer_is_not_busy():
    activity = Activity()
    end = ActivityLock(activity)
    with end:
        assert activity.busy()
        with end.waiting():  # e.g. a header waiting for its reservation: no bytes move
            assert end.locked() and not activity.busy()
        assert activity.busy()
    assert not activity.busy()
