import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: minutes of real processes (flower/test_deploy.py); deselected unless "
        "-m selects them: pytest -q -m slow flower/")


def pytest_collection_modifyitems(config, items):
    """The real-process tests run when -m asks for them (.ci/run: -m slow), not in the suite."""
    if config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture
def no_flower_left():
    """Fails the test if a Flower or nginx process it started is still running after it."""
    from test_flower import flower_processes, none_left
    before = flower_processes()
    yield
    assert none_left(before), "a process of the deployment is still running"
