"""The garbage collector paused during a start (sobrio/collector.py): nothing collected inside, the start's
objects frozen after, and collection on again only where it was on."""

import gc

from sobrio import collector


def test_no_collection_inside_and_the_survivors_frozen_after():
    frozen_before = gc.get_freeze_count()
    try:
        with collector.paused():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]  # tracked containers that survive the start
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(kept)
    finally:
        gc.unfreeze()


def test_a_collector_the_process_had_turned_off_stays_off():
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_an_offline_load_pauses_without_freezing_the_users_objects():
    frozen_before = gc.get_freeze_count()
    with collector.paused(freeze=False):
        assert not gc.isenabled()
        kept = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before and len(kept) == 1000
