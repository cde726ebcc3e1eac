"""Backups to L3 wait for a gap between the engine's forward passes, never longer than their bound."""

import threading

import pytest

from tests.storage_util import attach_fake, compute_and_insert, make_cache, random_tokens
from tierkv.cache.l3.pacing import BackupPacer
from tierkv.radix import RadixKey

PS = 16


def _run_in_thread(job) -> threading.Thread:
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    return thread


def test_a_backup_job_waits_for_the_forward_pass_to_end():
    pacer = BackupPacer(max_delay_s=3600.0)
    ran = threading.Event()
    with pacer.busy():
        thread = _run_in_thread(pacer.paced(ran.set))
        thread.join(0.2)  # a bounded look, not a speed check: the job is still held back
        assert thread.is_alive() and not ran.is_set()
    thread.join(10)
    assert ran.is_set() and pacer.delayed_jobs == 1


def test_a_backup_job_never_waits_past_its_bound():
    pacer = BackupPacer(max_delay_s=0.0)
    ran = threading.Event()
    with pacer.busy():  # a forward pass that never ends, as far as the job can tell
        _run_in_thread(pacer.paced(ran.set)).join(10)
        assert ran.is_set()


def test_an_idle_pacer_runs_jobs_at_once_and_a_failed_pass_leaves_it_idle():
    pacer = BackupPacer()
    with pytest.raises(RuntimeError):
        with pacer.busy():
            raise RuntimeError("forward pass failed")
    ran = []
    pacer.paced(lambda: ran.append(1))()
    assert ran == [1] and pacer.delayed_jobs == 0


@pytest.mark.parametrize("bad", [-1.0, "0.2", None])
def test_a_bad_bound_is_refused(bad):
    with pytest.raises(ValueError, match="max_delay_s"):
        BackupPacer(max_delay_s=bad)


def test_cache_backups_held_by_a_forward_pass_land_after_it():
    cache = make_cache(page_size=PS)
    store = attach_fake(cache)
    cache.storage.pacer.max_delay_s = 3600.0
    key = RadixKey(random_tokens(4 * PS, seed=1))
    with cache.storage.pacer.busy():
        compute_and_insert(cache, key, seed=2)
        cache.transfer.synchronize()
        cache.step()  # the write to L2 retires and queues the backup, which waits
        assert cache.storage.backups and not store.blobs
    cache.flush()
    assert len(store.blobs) == 4 and cache.storage.stats.backed_up_tokens == 4 * PS
    cache.check_integrity()
    cache.close()
