"""`temoe doctor` under JAX's mock GPU topology: the process is one rank of a mocked job (what bench/one_rank.py
measures), so doctor says what such a measurement can and cannot tell and refuses it as a training run."""

import pytest

from temoe.deploy import doctor


@pytest.mark.parametrize("environ, processes", [
    ({}, 0),
    ({"JAX_MOCK_GPU_TOPOLOGY": "128x8x1"}, 1024),
    ({"JAX_MOCK_GPU_TOPOLOGY": "16 x 8 x 1"}, 128),
    ({"MOCK_NUM_GPU_PROCESSES": "8"}, 8),
    ({"MOCK_NUM_GPU_PROCESSES": "0"}, 0),
    ({"JAX_MOCK_GPU_TOPOLOGY": "128x8"}, -1),
])
def test_mocked_processes_reads_both_of_jaxs_settings(environ, processes):
  assert doctor.mocked_processes(environ) == processes


def test_a_mocked_network_is_a_problem_that_says_what_one_rank_tells():
  report = doctor.Report()
  doctor._mocked_network(report, {"JAX_MOCK_GPU_TOPOLOGY": "128x8x1"})  # pylint: disable=protected-access
  assert report.lines == [("network", "mocked NCCL (128x8x1, 1024 processes): one rank of the job runs here, "
                                      "collectives move no data")]
  (problem,) = report.problems
  for said in ("compute at the job's real shapes", "peak HBM", "cannot tell anything of the network",
               "Unset JAX_MOCK_GPU_TOPOLOGY"):
    assert said in problem


def test_a_real_network_adds_nothing():
  report = doctor.Report()
  doctor._mocked_network(report, {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"})  # pylint: disable=protected-access
  assert not report.lines and not report.problems and not report.warnings
