"""Closed-form communication: the worked numbers of docs/performance.md. Agreement to the
byte with the collectives counted in the lowered StableHLO of every schedule is
``test_conformance.py::test_communication_matches_the_cost_model``."""
import pytest

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.lowering.schedule import schedules

MiB = 2 ** 20
WORKED = dict(seq_len=128 * 1024, heads=32, head_dim=128, cp=8, dtype_bytes=2, positions=False)


@pytest.mark.parametrize("kv_heads,ring_mib,ulysses_mib", [(32, 1792, 448), (8, 448, 280)])
def test_design_worked_numbers(kv_heads, ring_mib, ulysses_mib):
    ring = schedules()["ring"].volume(AttentionShape(kv_heads=kv_heads, **WORKED))
    ulysses = schedules()["ulysses"].volume(AttentionShape(kv_heads=kv_heads, **WORKED))
    assert ring.payload_bytes() == ring_mib * MiB == ring.forward_total
    assert ulysses.payload_bytes() == ulysses_mib * MiB == ulysses.forward_total
    allgather = schedules()["allgather"].volume(AttentionShape(kv_heads=kv_heads, **WORKED))
    assert allgather.forward_total == ring.forward_total


def test_backward_volumes():
    s, h, cp = WORKED["seq_len"], 4096, 8
    h_kv = h // 4
    kw = dict(WORKED, kv_heads=8)
    ulysses = schedules()["ulysses"].volume(AttentionShape(**kw))
    assert ulysses.backward == {"all_to_all": ulysses.forward_total}
    allgather = schedules()["allgather"].volume(AttentionShape(**kw))
    assert allgather.backward == {"reduce_scatter": 2 * s * h_kv * (cp - 1) // cp * 4}
    ring = schedules()["ring"].volume(AttentionShape(**kw))
    assert ring.backward_total == ring.forward_total + 2 * s * h_kv * 4
    hybrid = schedules()["hybrid"].volume(AttentionShape(ulysses=2, **kw))
    u, r = 2, 4
    a2a = (s // cp) * (2 * h + 2 * h_kv) * (u - 1) // u * 2
    kv_rotations = 2 * s * h_kv // u * (r - 1) // r * 2
    assert hybrid.forward_total == a2a + kv_rotations
    assert hybrid.backward_total == a2a + kv_rotations + 2 * s * h_kv // u * 4


def test_kv_head_replication_costs_the_same_as_a_gather():
    mqa = schedules()["ulysses"].volume(AttentionShape(seq_len=1024, heads=8, kv_heads=1,
                                                       head_dim=16, cp=8, positions=False))
    q_bytes = 1024 // 8 * 8 * 16 * 2 * 7 // 8
    assert mqa.forward["all_to_all"] == 2 * q_bytes + 2 * (1024 // 8 * 16 * 2 * 7)
