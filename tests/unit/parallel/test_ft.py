"""torchft replica groups without processes: batch shares, the lighthouse address, the config rules."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError
from tessera.parallel.ft import lighthouse_url, my_slots, slot_rows
from tessera.parallel.loss import MicroBatch

FT = ("parallel.fault_tolerance=torchft", "parallel.ft.lighthouse=127.0.0.1:29510")


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 6])
def test_every_share_of_the_batch_is_taken_once_whatever_the_quorum(replicas):
    for participants in range(1, replicas + 1):
        taken = sorted(s for rank in range(participants) for s in my_slots(replicas, participants, rank))
        assert taken == list(range(replicas)), (replicas, participants)
    assert my_slots(4, 2, None) == []  # a group outside the quorum takes nothing


def test_survivors_weigh_their_shares_to_the_full_batch_mean():
    """Shares weighted n / replicas, averaged over n groups: the mean over all shares (parallel/ft.py)."""
    values = torch.arange(4.0)
    for n in (1, 2, 4):
        per_group = [sum(values[s] * n / 4 for s in my_slots(4, n, r)) for r in range(n)]
        assert torch.isclose(sum(per_group) / n, values.mean())


def test_a_share_is_its_rows_of_every_tensor():
    tokens = torch.arange(8 * 3).reshape(8, 3)
    batch = MicroBatch((tokens,), {"positions": torch.arange(3), "document_ids": tokens * 2}, tokens + 1, None)
    part = slot_rows(batch, 2, 4)
    assert torch.equal(part.args[0], tokens[4:6]) and torch.equal(part.labels, tokens[4:6] + 1)
    assert torch.equal(part.kwargs["document_ids"], tokens[4:6] * 2)
    assert torch.equal(part.kwargs["positions"], torch.arange(3)) and part.loss_mask is None


@pytest.mark.parametrize(
    "address,url",
    [
        ("127.0.0.1:29510", "http://127.0.0.1:29510"),
        ("http://node7:80", "http://node7:80"),
        ("[::1]:9", "http://[::1]:9"),
    ],
)
def test_lighthouse_addresses(address, url):
    assert lighthouse_url(address) == url


@pytest.mark.parametrize("address", ["node7", "node7:", "http://node7:99999", "tcp://a:1", "a b:1", ":80"])
def test_a_lighthouse_address_that_does_not_parse_names_the_key(address):
    with pytest.raises(ConfigError, match="parallel.ft.lighthouse"):
        lighthouse_url(address)


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (("train.batch_size=6", "parallel.ft.replicas=4"), "train.batch_size=6 cannot be dealt over"),
        (("parallel.ft.replica_id=2",), "parallel.ft.replica_id=2 must be in 0..1"),
        (("parallel.ft.min_replicas=3",), "parallel.ft.min_replicas=3"),
        (("parallel.ft.lighthouse=nowhere",), "is not a lighthouse address"),
        (("parallel.tp=2", "parallel.sequence_parallel=false"), "fault tolerance (torchft replica groups) with tp"),
        (("parallel.dp_shard=2",), "fault tolerance (torchft replica groups) with fsdp"),
        (("train.on_spike=rollback",), "train.on_spike='rollback'"),
    ],
)
def test_fault_tolerance_config_errors_are_one_line(tiny_config, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        tiny_config(*FT, *overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_no_lighthouse_is_refused(tiny_config, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="needs parallel.ft.lighthouse"):
        tiny_config("parallel.fault_tolerance=torchft")
