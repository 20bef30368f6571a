"""The suite's `xdist_group` marks reach pytest-xdist: under `-n N --dist loadgroup` (setup.cfg)
the tests of one group run in one worker, so what a group's module fixtures compute (a killed
sweep, compiled programs) is computed once. pytest-xdist files a grouped test under its group
by suffixing its node id with "@group"; pytest 9 no longer reads the attribute it writes, and
every group was silently ignored (setup.cfg pins pytest below 9)."""

import os

import pytest


@pytest.mark.xdist_group("suite_groups")
def test_a_grouped_test_is_filed_under_its_group(request):
  if "PYTEST_XDIST_WORKER" not in os.environ or not request.config.getvalue("loadgroup"):
    pytest.skip("only under pytest-xdist with --dist loadgroup")
  assert request.node.nodeid.endswith("@suite_groups"), request.node.nodeid
