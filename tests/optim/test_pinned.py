"""flame.optim.pinned: what PyTorch's pinned allocator takes, and the host optimizer's arena that avoids its rounding."""

import torch

from flame.optim.pinned import CHUNK_BYTES, HostArena, allocated, arena_bytes, chunk_bytes_for

MIB = 1 << 20


def test_the_pinned_allocator_rounds_each_allocation_up_to_a_power_of_two():
    # a 7B block's float32 MLP weight (4096 x 11008) and attention weight (4096 x 4096)
    assert allocated(4 * 4096 * 11008) == 256 * MIB and allocated(4 * 4096 * 4096) == 64 * MIB
    assert [allocated(n) for n in (0, 1, 3, 4, 5)] == [0, 1, 4, 4, 8]


def test_the_arena_puts_each_tensor_in_the_first_chunk_with_room_and_pins_larger_ones_alone():
    chunk = 4096  # bytes: 1,024 float32 elements
    arena = HostArena(pin=True, chunk_bytes=chunk)  # placing only: no memory is pinned on a CPU machine
    assert [arena.place(n) for n in (600, 600, 400, 400, 24, 0, 2000)] == [
        (0, 0), (1, 0), (0, 600), (1, 600), (0, 1000), None, None]
    # two chunks, where one after the other (a new chunk whenever the last had no room) would take three; the
    # 2,000 elements alone, rounded up to 8,192 bytes
    assert arena_bytes([600, 600, 400, 400, 24, 0, 2000], chunk) == 2 * chunk + 8192
    assert arena_bytes([1024] * 3, chunk) == 3 * chunk  # a full chunk loses nothing


def test_a_jobs_chunk_is_its_whole_need_rounded_up_at_most_1_gib():
    assert chunk_bytes_for(3 * MIB) == 4 * MIB and chunk_bytes_for(50 << 30) == CHUNK_BYTES == 1 << 30


def test_without_pinning_the_arena_hands_out_plain_tensors_of_the_shapes_asked():
    arena = HostArena(pin=False, chunk_bytes=4096)
    taken = [arena.take(torch.Size(shape)) for shape in ((3, 5), (7,), ())]
    assert [t.shape for t in taken] == [torch.Size((3, 5)), torch.Size((7,)), torch.Size(())]
    assert all(t.dtype == torch.float32 and not t.is_pinned() for t in taken) and not arena.chunks
