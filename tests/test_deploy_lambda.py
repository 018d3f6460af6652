"""deployments/deploy_lambda.py under moto: create, update, a second run is a no-op.

moto cannot check: provisioned concurrency (not implemented; the calls are checked with a botocore
Stubber below), that the image exists/pulls and runs (MOTO_LAMBDA_STUB_ECR), an architecture
change (moto ignores Architectures in UpdateFunctionCode), IAM evaluation of the policies, and
Lambda's eventual consistency (waiters return at once, roles are assumable at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from botocore.stub import Stubber

from deployments import deploy_lambda as D

REGION = "us-east-1"
ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture()
def aws(monkeypatch):
    from moto import mock_aws

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION,
                 "AWS_SESSION_TOKEN": "testing"}.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        yield


def _spec(**kw) -> D.DeploySpec:
    base = dict(function_name="nitro-actor", memory_mb=1024, timeout_s=300, architecture="x86_64",
                reserved_concurrency=128, alias="live", region=REGION, image_tag="v1",
                secret_arn=f"arn:aws:secretsmanager:{REGION}:123456789012:secret:nitro/redis-actor-AbCdEf")
    base.update(kw)
    return D.DeploySpec(**base)


def test_create_then_second_run_is_a_noop(aws):
    import boto3

    first = D.deploy(_spec(), poll_s=0.01)
    text = "\n".join(first.changes)
    for expected in (
        "created ECR repository",
        "created role nitro-actor-role",
        "attached inline policy",
        "created log group /aws/lambda/nitro-actor",
        "created function nitro-actor",
        "set reserved concurrency of nitro-actor to 128",
        "published version 1",
        "created alias live -> 1",
    ):
        assert expected in text, (expected, first.changes)
    assert first.image_uri.endswith("/nitro-actor:v1") and first.version == "1"

    lam = boto3.client("lambda", region_name=REGION)
    cfg = lam.get_function_configuration(FunctionName="nitro-actor")
    assert cfg["PackageType"] == "Image" and cfg["MemorySize"] == 1024 and cfg["Timeout"] == 300
    assert cfg["Architectures"] == ["x86_64"] and cfg["Environment"]["Variables"]["MUJOCO_GL"] == "disable"
    assert lam.get_function_concurrency(FunctionName="nitro-actor")["ReservedConcurrentExecutions"] == 128
    assert lam.get_alias(FunctionName="nitro-actor", Name="live")["FunctionVersion"] == "1"
    iam = boto3.client("iam", region_name=REGION)
    policy = iam.get_role_policy(RoleName="nitro-actor-role", PolicyName="nitro-actor")["PolicyDocument"]
    actions = {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert actions == {"logs:CreateLogStream", "logs:PutLogEvents", "secretsmanager:GetSecretValue"}

    second = D.deploy(_spec(), poll_s=0.01)
    assert second.changes == []
    assert second.version == "1" and second.alias_arn == first.alias_arn


def test_updates_are_applied_once(aws):
    import boto3

    D.deploy(_spec(), poll_s=0.01)
    lam = boto3.client("lambda", region_name=REGION)

    upd = D.deploy(_spec(memory_mb=2048, timeout_s=120, environment={"NITRO_LOG": "info"}), poll_s=0.01)
    assert any("updated configuration of nitro-actor: " in c and "MemorySize" in c and "Timeout" in c
               and "Environment" in c for c in upd.changes), upd.changes
    assert any(c.startswith("moved alias live from 1 to") for c in upd.changes)
    assert lam.get_function_configuration(FunctionName="nitro-actor")["MemorySize"] == 2048
    assert D.deploy(_spec(memory_mb=2048, timeout_s=120, environment={"NITRO_LOG": "info"}), poll_s=0.01).changes == []

    v2 = dict(
        memory_mb=2048, timeout_s=120, environment={"NITRO_LOG": "info"}, image_tag="v2", reserved_concurrency=None
    )
    code = D.deploy(_spec(**v2), poll_s=0.01)
    text = "\n".join(code.changes)
    assert "updated code of nitro-actor to" in text and ":v2 (x86_64)" in text
    assert "removed reserved concurrency of nitro-actor (was 128)" in text
    assert lam.get_function(FunctionName="nitro-actor")["Code"]["ImageUri"].endswith(":v2")
    assert D.deploy(_spec(**v2), poll_s=0.01).changes == []

    # Architecture goes with the code (UpdateFunctionCode). moto does not store Architectures from
    # that call, so only the call is checked here, not a following no-op.
    arm = D.deploy(_spec(**v2, architecture="arm64"), poll_s=0.01)
    assert any(c.endswith(":v2 (arm64)") for c in arm.changes), arm.changes


def test_profile_aliases_per_memory_size(aws):
    import boto3

    spec = _spec(profile_memory_sizes=[512, 2048])
    first = D.deploy(spec, poll_s=0.01)
    assert set(first.profile_aliases) == {512, 2048}
    lam = boto3.client("lambda", region_name=REGION)
    for mem in (512, 2048):
        version = lam.get_alias(FunctionName="nitro-actor", Name=f"mem{mem}")["FunctionVersion"]
        assert lam.get_function_configuration(FunctionName="nitro-actor", Qualifier=version)["MemorySize"] == mem
    assert lam.get_function_configuration(FunctionName="nitro-actor")["MemorySize"] == 1024  # restored
    assert D.deploy(spec, poll_s=0.01).changes == []


def test_provisioned_concurrency_calls(aws):
    """moto has no provisioned concurrency: check the calls the deployer makes with a Stubber."""
    dep = D.Deployer(_spec(provisioned_concurrency=8), poll_s=0.01)
    with Stubber(dep.lam) as stub:
        stub.add_client_error(
            "get_provisioned_concurrency_config",
            "ProvisionedConcurrencyConfigNotFoundException",
            http_status_code=404,
            expected_params={"FunctionName": "nitro-actor", "Qualifier": "live"},
        )
        stub.add_response(
            "put_provisioned_concurrency_config",
            {"RequestedProvisionedConcurrentExecutions": 8},
            {"FunctionName": "nitro-actor", "Qualifier": "live", "ProvisionedConcurrentExecutions": 8},
        )
        dep.ensure_provisioned_concurrency("live")
        stub.add_response("get_provisioned_concurrency_config", {"RequestedProvisionedConcurrentExecutions": 8},
                          {"FunctionName": "nitro-actor", "Qualifier": "live"})
        dep.ensure_provisioned_concurrency("live")  # already 8: no call
        stub.assert_no_pending_responses()
    assert dep.changes == ["set provisioned concurrency on nitro-actor:live to 8 (was None)"]
    dep.spec.provisioned_concurrency = 0
    with Stubber(dep.lam) as stub:
        stub.add_response(
            "get_provisioned_concurrency_config",
            {"RequestedProvisionedConcurrentExecutions": 8},
            {"FunctionName": "nitro-actor", "Qualifier": "live"},
        )
        stub.add_response(
            "delete_provisioned_concurrency_config", {}, {"FunctionName": "nitro-actor", "Qualifier": "live"}
        )
        dep.ensure_provisioned_concurrency("live")
        stub.assert_no_pending_responses()


def test_invalid_specs_are_refused():
    for kw, msg in [(dict(memory_mb=64), "memory_mb"), (dict(timeout_s=901), "timeout_s"),
                    (dict(provisioned_concurrency=4, alias=None), "needs an alias"),
                    (dict(provisioned_concurrency=200, reserved_concurrency=100), "cannot exceed"),
                    (dict(subnet_ids=["subnet-1"]), "security group")]:
        with pytest.raises(ValueError, match=msg):
            _spec(**kw).validate()


def test_cli_main_twice(aws, capsys, tmp_path):
    cfg = tmp_path / "nitro.yaml"
    cfg.write_text("backend:\n  memory_mb: 1536\n  lambda:\n    function_name: nitro-cli\n    qualifier: live\n"
                   "    architecture: arm64\n    function_timeout_s: 120\n")
    argv = ["--config", str(cfg), "--image-tag", "abc123", "--reserved-concurrency", "64"]
    assert D.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["changes"] and out["image_uri"].endswith("/nitro-actor:abc123")
    assert D.main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["changes"] == [] and "nothing changed" in captured.err
    assert D.main([*argv, "--memory-mb", "64"]) == 2


def test_a_config_sets_what_the_functions_init_imports(tmp_path):
    """--config sets NITRO_PRELOAD as a local pool's preload for the same runs; --env overrides it."""
    cases = {"env_id: Hopper-v5\n": "nitro.actors.rollout",
             "env_id: ALE/Qbert-v5\n": "nitro.actors.rollout,nitro.models.networks",
             "env_id: Hopper-v5\nlearner:\n  mode: stellaris\n":
                 "nitro.actors.rollout,nitro.stellaris.function,nitro.stellaris.gradient"}
    for i, (yaml, want) in enumerate(cases.items()):
        cfg = tmp_path / f"nitro{i}.yaml"
        cfg.write_text(yaml)
        assert D.spec_from_args(["--config", str(cfg), "--env", "A=1"]).environment == {"NITRO_PRELOAD": want, "A": "1"}
    chosen = D.spec_from_args(["--config", str(cfg), "--env", "NITRO_PRELOAD=nitro.models.networks"])
    assert chosen.environment == {"NITRO_PRELOAD": "nitro.models.networks"}
    assert D.spec_from_args([]).environment == {}


def test_iam_policies_are_least_privilege():
    ph = dict(Partition="aws", Region=REGION, AccountId="123456789012", FunctionName="nitro-actor",
              RoleName="nitro-actor-role", EcrRepository="nitro-actor", SecretArn="arn:aws:secretsmanager:x:1:secret:s")
    invoker = D.render_policy("invoker-policy", **ph)
    (stmt,) = invoker["Statement"]
    assert stmt["Action"] == "lambda:InvokeFunction"
    assert stmt["Resource"] == ["arn:aws:lambda:us-east-1:123456789012:function:nitro-actor",
                                "arn:aws:lambda:us-east-1:123456789012:function:nitro-actor:*"]
    role = D.render_policy("function-role-policy", **ph)
    secret = D.render_policy("function-secret-policy", **ph)
    for doc in (invoker, role, secret):
        for s in doc["Statement"]:
            actions = [s["Action"]] if isinstance(s["Action"], str) else s["Action"]
            resources = [s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]
            assert all("*" not in a for a in actions) and "*" not in resources
    deployer = D.render_policy("deployer-policy", **ph)
    star = [s["Sid"] for s in deployer["Statement"] if s["Resource"] == "*"]
    assert sorted(star) == ["EcrLogin", "WhoAmI"]  # APIs without resource-level permissions
    trust = D.render_policy("function-trust-policy", **ph)
    assert trust["Statement"][0]["Principal"] == {"Service": "lambda.amazonaws.com"}


def test_sam_template_passes_cfn_lint():
    exe = os.path.join(os.path.dirname(sys.executable), "cfn-lint")  # from the test extras
    assert os.path.exists(exe), "cfn-lint is missing: run ./setup.sh (it is in the test extras)"
    template = os.path.join(ROOT, "deployments", "template.yaml")
    proc = subprocess.run([exe, "--regions", REGION, "--", template], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
