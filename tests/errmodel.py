"""The tests' oracle: the error model lives in ``mlarope.tools.errmodel`` (the stress run uses
it too); this module re-exports it for the tests."""

from mlarope.tools.errmodel import (  # noqa: F401
    U32,
    assert_close_elementwise,
    join_pairs,
    poisoned_like,
    rope_tolerance,
    split_pairs,
    table_bound,
    ulp,
    wrong_elements,
)
