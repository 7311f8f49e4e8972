"""The batch checks a loss collects (``require`` inside ``deferred_checks``) and the statistics it keeps on the
device (``read_stats``)."""

from __future__ import annotations

import pytest
import torch
from reads_back import ReadsBack

from retrieval.utils.reads import deferred_checks, known_on_host, on_host, read_checks, read_stats, require


def test_a_check_outside_deferred_checks_is_read_at_once():
    with ReadsBack() as reads:
        require(torch.tensor(True), ValueError("never"))
    assert reads.count == 1
    with pytest.raises(ValueError, match="failed"):
        require(torch.tensor(False), ValueError("failed"))


def test_the_innermost_deferred_checks_collects_and_the_outer_one_resumes_after_it():
    with deferred_checks() as outer:
        require(torch.tensor(True), ValueError("outer 1"))
        with deferred_checks() as inner:
            require(torch.tensor(False), ValueError("inner"))
        require(torch.tensor(False), ValueError("outer 2"))
    assert [str(error) for _, error in inner] == ["inner"]
    assert [str(error) for _, error in outer] == ["outer 1", "outer 2"]
    assert str(read_checks(outer)[1]) == "outer 2" and str(read_checks(inner)[1]) == "inner"


def test_checks_are_read_at_once_again_after_an_error_inside_deferred_checks():
    with pytest.raises(RuntimeError), deferred_checks():
        raise RuntimeError("the forward pass failed")
    with pytest.raises(ValueError, match="at once"):
        require(torch.tensor(False), ValueError("at once"))


def test_read_checks_reads_once_and_names_the_first_failed_check_made_only_then():
    made = []

    def error(name):
        def make():
            made.append(name)
            return ValueError(name)
        return make

    with deferred_checks() as checks:
        for name, holds in (("a", True), ("b", False), ("c", False)):
            require(torch.tensor(holds), error(name))
    with ReadsBack() as reads:
        failed = read_checks(checks)[1]
    assert (str(failed), made, reads.count) == ("b", ["b"], 1)
    assert read_checks([])[1] is None


def test_statistics_are_read_in_one_transfer_with_counts_exact():
    stats = {"share": torch.tensor(0.25), "count": torch.tensor(2**24 - 1), "rows": 7,
             "wide": torch.tensor(0.1, dtype=torch.float64)}
    with ReadsBack() as reads:
        numbers = read_stats(stats)
    assert numbers == {"share": 0.25, "count": float(2**24 - 1), "rows": 7.0, "wide": 0.1}
    assert reads.count == 1


def test_on_host_gives_the_callers_copy_of_that_very_tensor_only():
    sent, host = torch.tensor([3, 1, 2]), torch.tensor([7, 8, 9])  # values differ: shows which one is read
    with known_on_host(sent, host):
        assert on_host(sent) is host
        assert on_host(sent.clone()).tolist() == [3, 1, 2]  # another tensor: copied back
        with known_on_host(sent, host.to("meta")):  # not on the host: nothing known
            assert on_host(sent).tolist() == [3, 1, 2]
    assert on_host(sent).tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match="shape"), known_on_host(sent, host[:2]):
        pass
