"""The test tiers' table (`TIERS`, tests/conftest.py) follows the tests: every key names a test that exists."""


def test_every_key_of_the_tiers_table_names_a_test(stale_tiers):
    # A key that matches no test names a test renamed or moved: were it left, the test would slip into the quick
    # tier unnoticed. Checked only when the whole suite is collected (`make test`, `make test-full`).
    assert not stale_tiers, ("tests/conftest.py TIERS names tests that do not exist (renamed or moved? update the "
                             "table): " + ", ".join(stale_tiers))
