"""MLflow models-from-code entry of Nitro's policy model (see ``nitro.tracking.policy_model``).

MLflow copies this file into the model directory and runs it on load; it only names the model
class, so nothing is unpickled."""

from mlflow.models import set_model

from nitro.tracking.policy_model import PolicyModel

set_model(PolicyModel())
