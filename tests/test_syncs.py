"""lm_human_preference_details.syncs: the host-sync counter the benchmarks print counts each read of device values on
the host once, and nothing else."""

import torch

from lm_human_preference_details.syncs import count_host_syncs


def test_counts_each_host_read_once_and_no_pure_device_work():
    x = torch.arange(6.0).view(2, 3)
    with count_host_syncs() as syncs:
        y = (x * 2).softmax(-1).sum(0)  # device work only
    assert syncs.count == 0
    with count_host_syncs() as syncs:
        y.sum().item()  # one read (.item() and the _local_scalar_dense it runs count once together)
        if y.max() > 0:  # bool() of a tensor
            pass
        x[x > 2]  # boolean-mask indexing: the output shape depends on the values
        torch.nonzero(x)
    assert syncs.count == 4, syncs.events
    assert all("test_syncs.py" in event for event in syncs.events)  # each names the project's line


def test_values_already_on_the_host_are_not_counted_again():
    with count_host_syncs() as syncs:
        stats = torch.stack([torch.tensor(1.0), torch.tensor(2.0)]).cpu()  # the statistics copy: one read
        values = [stats[0].item(), stats.max().item(), stats.tolist()]
    assert syncs.count == 1, syncs.events
    assert values == [1.0, 2.0, [1.0, 2.0]]
