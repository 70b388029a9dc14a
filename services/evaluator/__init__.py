"""The evaluator: evaluation jobs (one suite on one candidate version) on rq, run on an evaluation engine."""
