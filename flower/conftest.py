def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: minutes of real processes (flower/test_flower.py; FLOWER_DEPLOY=1)")
