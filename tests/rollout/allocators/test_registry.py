"""The registry: every allocator by name, its options model, and errors that name what is wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.allocator_options import OPTIONS, ContrastiveOptions
from agentrl.errors import ConfigError
from agentrl.rollout.allocators import ALLOCATORS, Allocator, Contrastive, make_allocator


def test_registry_builds_every_allocator_by_name():
    assert set(ALLOCATORS) == {"independent", "pilot_commit", "entropy_branch", "segment_tree",
                               "key_state", "contrastive"}
    for name, cls in ALLOCATORS.items():
        alloc = make_allocator(name)
        assert isinstance(alloc, cls) and isinstance(alloc, Allocator)
        assert alloc.name == name
    assert make_allocator("independent", n=3).options.n == 3


def test_make_allocator_names_unknown_allocators_and_options():
    with pytest.raises(ValueError, match=r"unknown allocator 'pilot-commit' \(did you mean 'pilot_commit'\?\).*independent"):
        make_allocator("pilot-commit")
    with pytest.raises(ConfigError, match=r"unknown option 'widht' \(did you mean 'width'\?\); valid options: depth, width"):
        make_allocator("segment_tree", widht=3)
    with pytest.raises(ConfigError, match=r"allocator entropy_branch: option 'fresh_fraction': Input should be greater than 0"):
        make_allocator("entropy_branch", fresh_fraction=0.0)
    with pytest.raises(ValidationError, match=r"k\n  Input should be greater than or equal to 1"):
        Contrastive(ContrastiveOptions(k=0))


def test_every_allocator_takes_its_own_options_model():
    assert set(OPTIONS) == set(ALLOCATORS)
    for name, cls in ALLOCATORS.items():
        alloc = cls()
        assert type(alloc.options) is OPTIONS[name] and alloc.options.name == name
        assert make_allocator(OPTIONS[name]()) == alloc
    with pytest.raises(TypeError, match="options with a name"):
        make_allocator(OPTIONS["segment_tree"](), depth=2)
