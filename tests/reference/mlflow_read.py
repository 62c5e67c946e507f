"""Reads a run back from an MLflow tracking server with MLflow's own client, for
tests/mlflow_test.cpp: prints, as JSON, the run's params, tags, status, experiment name, every
metric's history ([step, value] in MLflow's order) and its artifact files.

  mlflow_read.py TRACKING_URI RUN_ID
"""
import json
import sys

from mlflow.tracking import MlflowClient

client = MlflowClient(tracking_uri=sys.argv[1])


def artifacts(run_id, path=None):
    # Every artifact file, folders walked.
    out = []
    for a in client.list_artifacts(run_id, path):
        out.extend(artifacts(run_id, a.path) if a.is_dir else [a.path])
    return sorted(out)


run = client.get_run(sys.argv[2])
history = {key: [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
print(json.dumps({
    "params": run.data.params,
    "tags": run.data.tags,
    "status": run.info.status,
    "experiment": client.get_experiment(run.info.experiment_id).name,
    "metrics": history,
    "artifacts": artifacts(run.info.run_id),
}))
