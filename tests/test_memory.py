"""The memory tracker: byte-accurate from storage, counted while the storage lives, current and peak by
category, activations once per storage."""

from __future__ import annotations

import gc

import pytest
import torch

from zero_core import dist, memory
from zero_core.cluster import VirtualCluster
from zero_core.context import phase
from zero_core.memory import MemoryTracker


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_the_vocabulary_holds_the_papers_model_states_and_the_transients():
    assert memory.MODEL_STATES == ("param.fp16", "grad.fp16", "master.fp32", "adam.m", "adam.v")
    for category in ("gather.fp16", "activations", "padding"):
        assert category in memory.CATEGORIES
    assert len(set(memory.CATEGORIES)) == len(memory.CATEGORIES)


def test_a_category_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="unknown memory category 'params'"):
        MemoryTracker().register(torch.ones(2), "params")


def test_totals_equal_the_bytes_of_the_registered_storages():
    tracker = MemoryTracker()
    tensors = {
        memory.PARAM: torch.ones(100, dtype=torch.float16),
        memory.GRAD: torch.ones(100, dtype=torch.bfloat16),
        memory.MASTER: torch.ones(100, dtype=torch.float32),
        memory.ADAM_M: torch.ones(3, 7, dtype=torch.float32),
        memory.ADAM_V: torch.ones(21, dtype=torch.float64),
    }
    for category, tensor in tensors.items():
        tracker.register(tensor, category)
        assert tracker.current_bytes(category) == tensor.untyped_storage().nbytes()
    assert tracker.current_bytes() == storage_bytes(*tensors.values()) == 200 + 200 + 400 + 84 + 168
    assert tracker.model_state_bytes() == tracker.current_bytes()


def test_a_view_counts_its_whole_storage():
    tracker = MemoryTracker()
    base = torch.ones(1000)
    view = tracker.register(base[10:20], memory.PARAM)
    assert tracker.current_bytes(memory.PARAM) == 4000 == storage_bytes(view)


def test_views_of_one_storage_count_once():
    tracker = MemoryTracker()
    flat = torch.ones(64, dtype=torch.float16)
    weight, bias = flat[:48].view(6, 8), flat[48:]
    for tensor in (flat, weight, bias, weight):
        tracker.register(tensor, memory.PARAM)
    assert tracker.current_bytes() == 128


def test_a_released_buffer_counts_until_it_is_freed_and_keeps_the_peak():
    tracker = MemoryTracker()
    gathered = tracker.register(torch.ones(256, dtype=torch.float16), memory.GATHER)
    tracker.release(gathered)
    assert tracker.current_bytes(memory.GATHER) == 512
    del gathered
    assert tracker.current_bytes() == 0
    assert tracker.peak_bytes(memory.GATHER) == 512


def test_a_collected_tensor_is_released_automatically():
    tracker = MemoryTracker()
    bucket = tracker.register(torch.ones(10), memory.GRAD_BUCKET)
    assert tracker.current_bytes() == 40
    del bucket
    gc.collect()
    assert tracker.current_bytes() == 0
    assert tracker.peak_bytes() == 40


def test_a_storage_is_released_when_its_last_registered_view_is_collected():
    tracker = MemoryTracker()
    flat = tracker.register(torch.ones(8), memory.PARAM)
    view = tracker.register(flat[:4], memory.PARAM)
    del flat
    gc.collect()
    assert tracker.current_bytes() == 32
    del view
    gc.collect()
    assert tracker.current_bytes() == 0


def test_a_released_then_reregistered_buffer_is_not_dropped_by_its_old_views():
    tracker = MemoryTracker()
    buffer = tracker.register(torch.ones(10), memory.GATHER)
    old_view = tracker.register(buffer[:5], memory.GATHER)
    tracker.release(buffer)
    tracker.register(buffer, memory.GATHER)
    del old_view
    gc.collect()
    assert tracker.current_bytes(memory.GATHER) == 40
    del buffer
    gc.collect()
    assert tracker.current_bytes(memory.GATHER) == 0


def test_peak_total_is_the_peak_of_the_sum_not_the_sum_of_peaks():
    tracker = MemoryTracker()
    first = tracker.register(torch.ones(100), memory.GATHER)
    kept = tracker.register(torch.ones(10), memory.PARAM)
    del first
    second = tracker.register(torch.ones(100), memory.GRAD_BUCKET)
    assert tracker.peak_bytes(memory.GATHER) == tracker.peak_bytes(memory.GRAD_BUCKET) == 400
    assert tracker.peak_bytes() == tracker.current_bytes() == 440
    del second
    assert tracker.peak_by_category()[memory.GRAD_BUCKET] == 400
    assert tracker.current_by_category() == {**dict.fromkeys(memory.CATEGORIES, 0), memory.PARAM: 40}
    assert tracker.is_tracked(kept)


def test_reset_peaks_starts_a_new_window_from_what_is_held():
    tracker = MemoryTracker()
    gathered = tracker.register(torch.ones(100), memory.GATHER)
    kept = tracker.register(torch.ones(10), memory.PARAM)
    del gathered
    tracker.reset_peaks()
    assert tracker.peak_bytes() == tracker.current_bytes() == 40
    assert tracker.peak_bytes(memory.GATHER) == 0
    assert tracker.is_tracked(kept)


def test_padding_is_reported_apart_from_the_model_states():
    tracker = MemoryTracker()
    shard = tracker.register(torch.zeros(16, dtype=torch.float16), memory.PARAM, padding_elements=3)
    assert tracker.current_bytes(memory.PARAM) == 26
    assert tracker.current_bytes(memory.PADDING) == 6
    assert tracker.model_state_bytes() == 26
    assert tracker.current_bytes() == 32
    del shard
    assert tracker.current_bytes(memory.PADDING) == 0


def test_padding_larger_than_the_buffer_is_refused():
    with pytest.raises(ValueError, match="padding of 20 bytes"):
        MemoryTracker().register(torch.zeros(4), memory.PARAM, padding_elements=5)


def test_the_timeline_records_every_change_with_the_running_total():
    tracker = MemoryTracker()
    tracker.phase, tracker.step = "optimizer", 3
    master = tracker.register(torch.ones(4), memory.MASTER, label="blocks.0")
    param = tracker.register(torch.ones(2, dtype=torch.float16), memory.PARAM, label="blocks.0")
    del master
    events = tracker.timeline
    assert [(e.index, e.category, e.delta_bytes, e.total_bytes) for e in events] == [
        (0, memory.MASTER, 16, 16),
        (1, memory.PARAM, 4, 20),
        (2, memory.MASTER, -16, 4),
    ]
    assert all(e.label == "blocks.0" and e.phase == "optimizer" and e.step == 3 for e in events)
    assert events[0].seconds <= events[1].seconds <= events[2].seconds
    assert tracker.is_tracked(param)


def test_a_tracker_without_timeline_still_counts():
    tracker = MemoryTracker(record_timeline=False)
    param = tracker.register(torch.ones(4), memory.PARAM)
    assert tracker.timeline == [] and tracker.current_bytes() == 16 == storage_bytes(param)


def test_inside_a_rank_events_carry_the_ranks_step_and_phase():
    def fn():
        ctx = dist.current()
        ctx.step = 5
        with phase("forward"):
            buffer = ctx.tracker.register(torch.ones(4), memory.GATHER)
        del buffer
        return [(e.phase, e.step) for e in ctx.tracker.timeline]

    assert VirtualCluster(2).run(fn) == [[("forward", 5), ("", 5)]] * 2


def test_each_rank_has_its_own_tracker():
    def fn():
        tensor = torch.ones(dist.get_rank() + 1)
        dist.current().tracker.register(tensor, memory.PARAM)
        return dist.current().tracker.current_bytes(), tensor

    cluster = VirtualCluster(3)
    results = cluster.run(fn)
    assert [held for held, _ in results] == [4, 8, 12]
    assert [t.rank for t in cluster.trackers] == [0, 1, 2]


def test_activations_saved_for_backward_are_counted_once_per_storage():
    tracker = MemoryTracker()
    x = torch.randn(100, requires_grad=True)
    with tracker.count_activations():
        a = x.exp()  # saves its result a
        b = a.sin()  # saves its input a again
        loss = (b * b).sum()  # saves b twice
    assert tracker.current_bytes(memory.ACTIVATIONS) == storage_bytes(a, b) == 800
    del a, b
    loss.backward()
    gc.collect()
    assert tracker.current_bytes(memory.ACTIVATIONS) == 0
    assert tracker.peak_bytes(memory.ACTIVATIONS) == 800


def test_tensors_already_on_the_ledger_are_not_counted_again_as_activations():
    tracker = MemoryTracker()
    weight = tracker.register(torch.randn(8, 8, requires_grad=True), memory.PARAM)
    x = torch.randn(4, 8, requires_grad=True)
    with tracker.count_activations():
        loss = (x @ weight).sum()
    assert tracker.current_bytes(memory.PARAM) == 256
    assert tracker.current_bytes(memory.ACTIVATIONS) == storage_bytes(x) == 128
    loss.backward()


def test_nothing_is_counted_outside_count_activations():
    tracker = MemoryTracker()
    x = torch.randn(10, requires_grad=True)
    with tracker.count_activations():
        pass
    x.exp().sum().backward()
    assert tracker.current_bytes() == 0
