"""A model's version in its route's name: ``model@version``, written and read in one place."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from quantroute.types import split_version, versioned_name

NAMES = st.text(st.characters(blacklist_characters="@"), min_size=1, max_size=20)


@given(model=NAMES, version=st.one_of(st.none(), NAMES))
def test_a_versioned_name_splits_back_into_its_model_and_version(
    model: str, version: str | None
) -> None:
    assert split_version(versioned_name(model, version)) == (model, version)


def test_a_name_without_a_version_is_the_model_alone() -> None:
    assert versioned_name("m", None) == "m" and split_version("m") == ("m", None)
    assert versioned_name("m", "v2") == "m@v2" and split_version("m@v2") == ("m", "v2")
    assert split_version("m@") == ("m", None)  # an empty version is none
