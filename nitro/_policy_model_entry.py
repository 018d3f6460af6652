"""MLflow models-from-code entry of Nitro's policy model (see ``nitro.policy_model``).

MLflow copies this file into the model directory and runs it on load; it only names the model
class, so nothing is unpickled."""

from mlflow.models import set_model

from nitro.policy_model import PolicyModel

set_model(PolicyModel())
