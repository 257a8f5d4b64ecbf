"""Parametrize ``case`` over each tester class's ``param_cases()``."""
from tests.ops.base import case_id


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames and metafunc.cls is not None:
        cases = metafunc.cls.param_cases()
        metafunc.parametrize("case", cases, ids=[case_id(c) for c in cases])
