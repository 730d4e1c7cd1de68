"""The kernel tests' fixture over each form of one of our kernels (AVX-512 or VNNI, AVX2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hcache.kernels.cpu import cpu


def form_fixture(forms: dict[str, Callable[[], Any]]) -> Any:
    """A fixture over `forms` by name: each form's op, or a skip naming this CPU's kind where
    the form does not run here (its getter gives None)."""

    @pytest.fixture(params=sorted(forms))
    def op(request: pytest.FixtureRequest) -> Any:
        form = forms[request.param]()
        if form is None:
            pytest.skip(f"the {request.param} form does not run on this CPU ({cpu().kind})")
        return form

    return op
