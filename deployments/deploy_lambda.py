"""Deploy the Nitro actor function to AWS Lambda with boto3. Idempotent: a second run changes nothing.

    python -m deployments.deploy_lambda --image-uri 123456789012.dkr.ecr.us-east-1.amazonaws.com/nitro-actor:3f2c1ab \\
        --memory-mb 1024 --timeout-s 300 --architecture x86_64 \\
        --reserved-concurrency 256 --provisioned-concurrency 8 --alias live \\
        --secret-arn arn:aws:secretsmanager:us-east-1:123456789012:secret:nitro/redis-actor-AbCdEf \\
        --subnet-ids subnet-1,subnet-2 --security-group-ids sg-1

What it does, each step only when the live state differs from the wanted one:

1. the ECR repository (scan on push), whose URI is the default image location;
2. the function's execution role (unless ``--role-arn``): trust policy for lambda.amazonaws.com
   scoped to this function, an inline least-privilege policy (its own log streams; the Redis
   secret if ``--secret-arn``), and AWSLambdaVPCAccessExecutionRole when it runs in a VPC;
3. the log group ``/aws/lambda/<name>`` with a retention (so the role needs no CreateLogGroup);
4. the function from the image URI: memory, timeout, architecture, environment, ephemeral
   storage, VPC. An image tag that now points at a new digest in ECR counts as a change;
5. reserved concurrency (``--reserved-concurrency``; omitted = unreserved, an existing
   reservation is removed);
6. ``--alias``: a version is published only when $LATEST differs from the alias's version (code
   digest or configuration), then the alias points at it; provisioned concurrency on that alias;
7. ``--profile-memory 512,1024,2048``: one published version and alias ``mem<N>`` per size, for
   ``nitro profile-actor``; $LATEST is restored to ``--memory-mb`` afterwards.

The result lists every change made (``[]`` on a second run) as JSON. Defaults come from a Nitro
config (``--config nitro.yaml``: ``backend.lambda.*`` and ``backend.memory_mb``) when given, and
from it the modules the function's INIT imports (``NITRO_PRELOAD``: PyTorch's networks for an image
env, the learner function's for Stellaris; ``--env NITRO_PRELOAD=...`` overrides it).
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

IAM_DIR = Path(__file__).resolve().parent / "iam"
VPC_POLICY_ARN = "arn:{partition}:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole"
MANAGED_TAG = {"managed-by": "nitro-deploy"}


@dataclass
class DeploySpec:
    function_name: str = "nitro-actor"
    image_uri: str | None = None  # default: <ecr repository URI>:<image_tag>
    ecr_repository: str = "nitro-actor"
    image_tag: str = "latest"
    memory_mb: int = 1024
    timeout_s: int = 300
    architecture: Literal["x86_64", "arm64"] = "x86_64"
    ephemeral_storage_mb: int = 512
    role_arn: str | None = None  # default: create/maintain role <function_name>-role
    environment: dict[str, str] = field(default_factory=dict)
    secret_arn: str | None = None  # Secrets Manager secret with the Redis actor password
    subnet_ids: list[str] = field(default_factory=list)
    security_group_ids: list[str] = field(default_factory=list)
    reserved_concurrency: int | None = None
    alias: str | None = None  # e.g. "live"; required for provisioned concurrency
    provisioned_concurrency: int = 0
    profile_memory_sizes: list[int] = field(default_factory=list)
    log_retention_days: int = 14
    region: str = "us-east-1"
    endpoint_url: str | None = None  # e.g. a moto server
    description: str = "Nitro RL actor (rollout -> Redis)"

    def validate(self) -> None:
        if not (128 <= self.memory_mb <= 10240):
            raise ValueError(f"memory_mb must be within 128..10240, got {self.memory_mb}")
        if not (1 <= self.timeout_s <= 900):
            raise ValueError(f"timeout_s must be within 1..900, got {self.timeout_s}")
        if self.architecture not in ("x86_64", "arm64"):
            raise ValueError(f"architecture must be x86_64 or arm64, got {self.architecture!r}")
        if self.provisioned_concurrency and not self.alias:
            raise ValueError("provisioned concurrency needs an alias (--alias live)")
        if self.provisioned_concurrency < 0 or (self.reserved_concurrency is not None
                                                and self.reserved_concurrency < 0):
            raise ValueError("concurrency settings must not be negative")
        if (self.reserved_concurrency is not None and self.provisioned_concurrency > self.reserved_concurrency):
            raise ValueError("provisioned concurrency cannot exceed reserved concurrency")
        if bool(self.subnet_ids) != bool(self.security_group_ids):
            raise ValueError("a VPC function needs both subnet ids and security group ids")
        for m in self.profile_memory_sizes:
            if not (128 <= m <= 10240):
                raise ValueError(f"profile memory size {m} is outside 128..10240")

    @property
    def role_name(self) -> str:
        return f"{self.function_name}-role"


@dataclass
class DeployResult:
    function_arn: str
    image_uri: str
    role_arn: str
    alias_arn: str | None
    version: str | None
    changes: list[str]
    profile_aliases: dict[int, str] = field(default_factory=dict)


def render_policy(name: str, **values: str) -> dict[str, Any]:
    """Load ``iam/<name>.json`` with ``${Placeholders}`` substituted (all must be given)."""
    text = (IAM_DIR / f"{name}.json").read_text()
    return json.loads(string.Template(text).substitute(values))


def _code(exc: Exception) -> str:
    return getattr(exc, "response", {}).get("Error", {}).get("Code", "") if hasattr(exc, "response") else ""


class Deployer:
    """One deployment; ``run()`` returns what it changed."""

    def __init__(self, spec: DeploySpec, session: Any = None, poll_s: float = 2.0):
        import boto3

        spec.validate()
        self.spec = spec
        self.session = session or boto3.session.Session(region_name=spec.region)
        region, endpoint = spec.region, spec.endpoint_url
        self.lam = self.session.client("lambda", region_name=region, endpoint_url=endpoint)
        self.ecr = self.session.client("ecr", region_name=region, endpoint_url=endpoint)
        self.iam = self.session.client("iam", region_name=region, endpoint_url=endpoint)
        self.logs = self.session.client("logs", region_name=region, endpoint_url=endpoint)
        self.sts = self.session.client("sts", region_name=region, endpoint_url=endpoint)
        self.poll_s = poll_s
        self.changes: list[str] = []
        ident = self.sts.get_caller_identity()
        self.account = ident["Account"]
        arn = ident.get("Arn", "arn:aws:")
        self.partition = arn.split(":")[1] if arn.startswith("arn:") else "aws"

    def _placeholders(self) -> dict[str, str]:
        return dict(Partition=self.partition, Region=self.spec.region, AccountId=self.account,
                    FunctionName=self.spec.function_name, RoleName=self.spec.role_name,
                    EcrRepository=self.spec.ecr_repository, SecretArn=self.spec.secret_arn or "")

    def _change(self, what: str) -> None:
        self.changes.append(what)

    # -- ECR -------------------------------------------------------------------------------

    def ensure_repository(self) -> str:
        try:
            repo = self.ecr.describe_repositories(repositoryNames=[self.spec.ecr_repository])["repositories"][0]
        except self.ecr.exceptions.RepositoryNotFoundException:
            repo = self.ecr.create_repository(
                repositoryName=self.spec.ecr_repository,
                imageScanningConfiguration={"scanOnPush": True},
                tags=[{"Key": k, "Value": v} for k, v in MANAGED_TAG.items()],
            )["repository"]
            self._change(f"created ECR repository {repo['repositoryUri']}")
        return repo["repositoryUri"]

    def _image_digest(self, image_uri: str) -> str | None:
        """The digest the tag of ``image_uri`` points at in our repository now (None: unknown)."""
        if "@" in image_uri:
            return image_uri.split("@", 1)[1]
        repo_part, _, tag = image_uri.rpartition(":")
        if not repo_part.endswith("/" + self.spec.ecr_repository) or not tag:
            return None
        try:
            details = self.ecr.describe_images(repositoryName=self.spec.ecr_repository,
                                               imageIds=[{"imageTag": tag}])["imageDetails"]
        except Exception:
            return None
        return details[0].get("imageDigest") if details else None

    # -- IAM -------------------------------------------------------------------------------

    def ensure_role(self) -> str:
        if self.spec.role_arn:
            return self.spec.role_arn
        ph = self._placeholders()
        trust = render_policy("function-trust-policy", **ph)
        name = self.spec.role_name
        try:
            role = self.iam.get_role(RoleName=name)["Role"]
            current = role.get("AssumeRolePolicyDocument")
            if isinstance(current, str):
                current = json.loads(current)
            if current != trust:
                self.iam.update_assume_role_policy(RoleName=name, PolicyDocument=json.dumps(trust))
                self._change(f"updated trust policy of role {name}")
        except self.iam.exceptions.NoSuchEntityException:
            role = self.iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust),
                                        Description="Nitro actor function execution role",
                                        Tags=[{"Key": k, "Value": v} for k, v in MANAGED_TAG.items()])["Role"]
            self._change(f"created role {name}")
        policy = render_policy("function-role-policy", **ph)
        if self.spec.secret_arn:
            policy["Statement"] += render_policy("function-secret-policy", **ph)["Statement"]
        try:
            current = self.iam.get_role_policy(RoleName=name, PolicyName="nitro-actor")["PolicyDocument"]
            if isinstance(current, str):
                current = json.loads(current)
        except self.iam.exceptions.NoSuchEntityException:
            current = None
        if current != policy:
            self.iam.put_role_policy(RoleName=name, PolicyName="nitro-actor", PolicyDocument=json.dumps(policy))
            self._change(f"{'updated' if current else 'attached'} inline policy nitro-actor on role {name}")
        if self.spec.subnet_ids:
            vpc_arn = VPC_POLICY_ARN.format(partition=self.partition)
            attached = {p["PolicyArn"] for p in self.iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]}
            if vpc_arn not in attached:
                self.iam.attach_role_policy(RoleName=name, PolicyArn=vpc_arn)
                self._change(f"attached AWSLambdaVPCAccessExecutionRole to role {name}")
        return role["Arn"]

    # -- logs ------------------------------------------------------------------------------

    def ensure_log_group(self) -> None:
        group = f"/aws/lambda/{self.spec.function_name}"
        groups = self.logs.describe_log_groups(logGroupNamePrefix=group)["logGroups"]
        found = [g for g in groups if g["logGroupName"] == group]
        if not found:
            self.logs.create_log_group(logGroupName=group)
            self._change(f"created log group {group}")
            retention = None
        else:
            retention = found[0].get("retentionInDays")
        if retention != self.spec.log_retention_days:
            self.logs.put_retention_policy(logGroupName=group, retentionInDays=self.spec.log_retention_days)
            self._change(f"set log retention of {group} to {self.spec.log_retention_days} days")

    # -- the function ----------------------------------------------------------------------

    def _wanted_config(self, role_arn: str, memory_mb: int | None = None) -> dict[str, Any]:
        env = {"MUJOCO_GL": "disable", **self.spec.environment}
        cfg: dict[str, Any] = dict(
            Role=role_arn,
            MemorySize=memory_mb or self.spec.memory_mb,
            Timeout=self.spec.timeout_s,
            Environment={"Variables": env},
            EphemeralStorage={"Size": self.spec.ephemeral_storage_mb},
            Description=self.spec.description,
        )
        cfg["VpcConfig"] = {"SubnetIds": list(self.spec.subnet_ids),
                            "SecurityGroupIds": list(self.spec.security_group_ids)}
        return cfg

    @staticmethod
    def _config_diff(current: Mapping[str, Any], wanted: dict[str, Any]) -> list[str]:
        diff = []
        for key, value in wanted.items():
            have = current.get(key)
            if key == "Environment":
                have = (have or {}).get("Variables", {})
                value = value["Variables"]
            elif key == "EphemeralStorage":
                have = (have or {}).get("Size", 512)
                value = value["Size"]
            elif key == "VpcConfig":
                have = have or {}
                have = (sorted(have.get("SubnetIds") or []), sorted(have.get("SecurityGroupIds") or []))
                value = (sorted(value["SubnetIds"]), sorted(value["SecurityGroupIds"]))
            elif key == "Description":
                have = have or ""
            if have != value:
                diff.append(key)
        return diff

    def _wait(self, waiter: Literal["function_active_v2", "function_updated_v2"]) -> None:
        self.lam.get_waiter(waiter).wait(
            FunctionName=self.spec.function_name,
            WaiterConfig={"Delay": self.poll_s,  # type: ignore[typeddict-item]  # int in the stubs; floats work
                          "MaxAttempts": int(600 / max(self.poll_s, 0.1))})

    def _retry_role_propagation(self, call, **kwargs):
        """A role created seconds ago may not be assumable by Lambda yet (IAM is eventually consistent)."""
        deadline = time.monotonic() + 90
        while True:
            try:
                return call(**kwargs)
            except Exception as exc:
                if (_code(exc) == "InvalidParameterValueException" and "assume" in str(exc).lower()
                        and time.monotonic() < deadline):
                    time.sleep(self.poll_s * 2)
                    continue
                raise

    def ensure_function(self, role_arn: str, image_uri: str) -> Mapping[str, Any]:
        name = self.spec.function_name
        wanted = self._wanted_config(role_arn)
        try:
            fn = self.lam.get_function(FunctionName=name)
        except self.lam.exceptions.ResourceNotFoundException:
            self._retry_role_propagation(
                self.lam.create_function, FunctionName=name, PackageType="Image", Code={"ImageUri": image_uri},
                Architectures=[self.spec.architecture], Publish=False,
                Tags=dict(MANAGED_TAG), **wanted,
            )
            self._change(f"created function {name} from {image_uri}")
            self._wait("function_active_v2")
            return self.lam.get_function_configuration(FunctionName=name)
        cfg = fn["Configuration"]
        code = fn.get("Code", {})
        code_changed = (code.get("ImageUri") != image_uri
                        or (cfg.get("Architectures") or ["x86_64"]) != [self.spec.architecture])
        if not code_changed:
            digest = self._image_digest(image_uri)
            resolved = code.get("ResolvedImageUri") or ""
            if digest and "@" in resolved and resolved.split("@", 1)[1] != digest:
                code_changed = True  # the tag was pushed again: redeploy to pick up the new digest
        if code_changed:
            self._wait("function_updated_v2")
            self.lam.update_function_code(FunctionName=name, ImageUri=image_uri, Architectures=[self.spec.architecture])
            self._change(f"updated code of {name} to {image_uri} ({self.spec.architecture})")
            self._wait("function_updated_v2")
        diff = self._config_diff(cfg, wanted)
        if diff:
            self._wait("function_updated_v2")
            self._retry_role_propagation(self.lam.update_function_configuration, FunctionName=name, **wanted)
            self._change(f"updated configuration of {name}: {', '.join(diff)}")
            self._wait("function_updated_v2")
        return self.lam.get_function_configuration(FunctionName=name)

    def ensure_reserved_concurrency(self) -> None:
        name = self.spec.function_name
        current = self.lam.get_function_concurrency(FunctionName=name).get("ReservedConcurrentExecutions")
        wanted = self.spec.reserved_concurrency
        if wanted is None and current is not None:
            self.lam.delete_function_concurrency(FunctionName=name)
            self._change(f"removed reserved concurrency of {name} (was {current})")
        elif wanted is not None and current != wanted:
            self.lam.put_function_concurrency(FunctionName=name, ReservedConcurrentExecutions=wanted)
            self._change(f"set reserved concurrency of {name} to {wanted} (was {current})")

    # -- versions, aliases, provisioned concurrency ----------------------------------------

    _VERSION_KEYS = ("CodeSha256", "MemorySize", "Timeout", "Role", "Environment", "EphemeralStorage", "Architectures")

    def _same_version(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
        def norm(c: Mapping[str, Any]) -> dict[str, Any]:
            out = {k: c.get(k) for k in self._VERSION_KEYS}
            out["Environment"] = (out["Environment"] or {}).get("Variables", {})
            out["EphemeralStorage"] = (out["EphemeralStorage"] or {}).get("Size", 512)
            out["Architectures"] = out["Architectures"] or ["x86_64"]
            return out

        return norm(a) == norm(b)

    def ensure_alias(self, alias: str, latest: Mapping[str, Any], what: str = "") -> tuple[str, str]:
        """Point ``alias`` at a published version equal to $LATEST; publish only if none is."""
        name = self.spec.function_name
        try:
            current = self.lam.get_alias(FunctionName=name, Name=alias)
        except self.lam.exceptions.ResourceNotFoundException:
            current = None
        if current is not None:
            target = self.lam.get_function_configuration(FunctionName=name, Qualifier=current["FunctionVersion"])
            if self._same_version(target, latest):
                return current["AliasArn"], current["FunctionVersion"]
        self._wait("function_updated_v2")
        description = what or f"nitro deploy {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        version = self.lam.publish_version(FunctionName=name, CodeSha256=latest["CodeSha256"],
                                           Description=description)["Version"]
        self._change(f"published version {version} of {name}")
        if current is None:
            arn = self.lam.create_alias(FunctionName=name, Name=alias, FunctionVersion=version)["AliasArn"]
            self._change(f"created alias {alias} -> {version}")
        else:
            arn = self.lam.update_alias(FunctionName=name, Name=alias, FunctionVersion=version)["AliasArn"]
            self._change(f"moved alias {alias} from {current['FunctionVersion']} to {version}")
        return arn, version

    def ensure_provisioned_concurrency(self, alias: str) -> None:
        """Not checkable under moto (it does not implement provisioned concurrency)."""
        name = self.spec.function_name
        wanted = self.spec.provisioned_concurrency
        try:
            current = self.lam.get_provisioned_concurrency_config(FunctionName=name, Qualifier=alias)
            have = current.get("RequestedProvisionedConcurrentExecutions")
        except Exception as exc:  # 404 ProvisionedConcurrencyConfigNotFoundException: none configured
            if getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
            have = None
        if wanted == 0 and have is not None:
            self.lam.delete_provisioned_concurrency_config(FunctionName=name, Qualifier=alias)
            self._change(f"removed provisioned concurrency on {name}:{alias} (was {have})")
        elif wanted > 0 and have != wanted:
            self.lam.put_provisioned_concurrency_config(FunctionName=name, Qualifier=alias,
                                                        ProvisionedConcurrentExecutions=wanted)
            self._change(f"set provisioned concurrency on {name}:{alias} to {wanted} (was {have})")

    def ensure_profile_aliases(self, role_arn: str) -> dict[int, str]:
        """One version + alias ``mem<N>`` per profiling memory size; $LATEST is restored afterwards."""
        name = self.spec.function_name
        out: dict[int, str] = {}
        touched = False
        for mem in sorted(set(self.spec.profile_memory_sizes)):
            alias = f"mem{mem}"
            latest = self.lam.get_function_configuration(FunctionName=name)
            want = dict(latest, MemorySize=mem)
            try:
                cur = self.lam.get_alias(FunctionName=name, Name=alias)
                target = self.lam.get_function_configuration(FunctionName=name, Qualifier=cur["FunctionVersion"])
                if self._same_version(target, want):
                    out[mem] = cur["AliasArn"]
                    continue
            except self.lam.exceptions.ResourceNotFoundException:
                pass
            if latest["MemorySize"] != mem:
                self._wait("function_updated_v2")
                self.lam.update_function_configuration(FunctionName=name, MemorySize=mem)
                self._wait("function_updated_v2")
                touched = True
            latest = self.lam.get_function_configuration(FunctionName=name)
            out[mem], _ = self.ensure_alias(alias, latest, what=f"nitro profile {mem} MB")
        if touched:
            self._wait("function_updated_v2")
            self.lam.update_function_configuration(FunctionName=name, MemorySize=self.spec.memory_mb)
            self._wait("function_updated_v2")
        return out

    # -- all of it -------------------------------------------------------------------------

    def run(self) -> DeployResult:
        repo_uri = self.ensure_repository()
        image_uri = self.spec.image_uri or f"{repo_uri}:{self.spec.image_tag}"
        role_arn = self.ensure_role()
        self.ensure_log_group()
        latest = self.ensure_function(role_arn, image_uri)
        self.ensure_reserved_concurrency()
        alias_arn = version = None
        if self.spec.alias:
            alias_arn, version = self.ensure_alias(self.spec.alias, latest)
            self.ensure_provisioned_concurrency(self.spec.alias)
        profile = self.ensure_profile_aliases(role_arn) if self.spec.profile_memory_sizes else {}
        return DeployResult(function_arn=latest["FunctionArn"], image_uri=image_uri, role_arn=role_arn,
                            alias_arn=alias_arn, version=version, changes=list(self.changes), profile_aliases=profile)


def deploy(spec: DeploySpec, session: Any = None, poll_s: float = 2.0) -> DeployResult:
    """Create or update everything ``spec`` describes; ``result.changes`` is ``[]`` when nothing differed."""
    return Deployer(spec, session=session, poll_s=poll_s).run()


# -- command line --------------------------------------------------------------------------------


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def spec_from_args(argv: list[str] | None = None) -> DeploySpec:
    p = argparse.ArgumentParser(prog="python -m deployments.deploy_lambda", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="Nitro config YAML: defaults from backend.lambda.* and backend.memory_mb")
    p.add_argument("--function-name")
    p.add_argument("--image-uri", help="ECR image URI (default: <repository URI>:<--image-tag>)")
    p.add_argument("--image-tag", default="latest")
    p.add_argument("--ecr-repository")
    p.add_argument("--memory-mb", type=int)
    p.add_argument("--timeout-s", type=int)
    p.add_argument("--architecture", choices=["x86_64", "arm64"])
    p.add_argument("--ephemeral-storage-mb", type=int, default=512)
    p.add_argument("--role-arn", help="use this execution role instead of creating <function>-role")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="function environment variable (no secrets)")
    p.add_argument("--secret-arn",
                   help="Secrets Manager secret holding the Redis actor password (the role may read it)")
    p.add_argument("--subnet-ids", help="comma-separated; with --security-group-ids (ElastiCache lives in a VPC)")
    p.add_argument("--security-group-ids")
    p.add_argument("--reserved-concurrency", type=int, help="omit for none (an existing reservation is removed)")
    p.add_argument("--alias", help="publish a version and point this alias at it (the invoker's qualifier)")
    p.add_argument("--provisioned-concurrency", type=int)
    p.add_argument("--profile-memory", help="comma-separated MB sizes: aliases mem<N> for `nitro profile-actor`")
    p.add_argument("--log-retention-days", type=int, default=14)
    p.add_argument("--region")
    p.add_argument("--endpoint-url", help="AWS endpoint override (e.g. a moto server)")
    a = p.parse_args(argv)

    spec = DeploySpec()
    if a.config:
        from nitro.config import NitroConfig

        cfg = NitroConfig.from_yaml(a.config)
        lam = cfg.backend.lambda_
        spec.function_name, spec.region, spec.architecture = lam.function_name, lam.region, lam.architecture
        spec.timeout_s, spec.memory_mb = lam.function_timeout_s, cfg.backend.memory_mb
        spec.provisioned_concurrency = lam.provisioned_concurrency
        if lam.qualifier and not lam.qualifier.isdigit() and lam.qualifier != "$LATEST":
            spec.alias = lam.qualifier
        from nitro.actors.preload import warm_modules_for

        # what the function's INIT imports for this config's runs (actor_lambda/handler.py)
        spec.environment["NITRO_PRELOAD"] = ",".join(warm_modules_for(cfg))
    for attr in ("function_name", "image_uri", "ecr_repository", "memory_mb", "timeout_s", "architecture", "role_arn",
                 "secret_arn", "reserved_concurrency", "alias", "provisioned_concurrency", "region", "endpoint_url"):
        value = getattr(a, attr)
        if value is not None:
            setattr(spec, attr, value)
    if a.ecr_repository is None and a.function_name:
        spec.ecr_repository = a.function_name
    spec.image_tag = a.image_tag
    spec.ephemeral_storage_mb = a.ephemeral_storage_mb
    spec.log_retention_days = a.log_retention_days
    spec.environment.update(item.split("=", 1) for item in a.env)
    spec.subnet_ids, spec.security_group_ids = _csv(a.subnet_ids), _csv(a.security_group_ids)
    spec.profile_memory_sizes = [int(x) for x in _csv(a.profile_memory)]
    if spec.provisioned_concurrency and not spec.alias:
        spec.alias = "live"
    return spec


def main(argv: list[str] | None = None) -> int:
    try:
        spec = spec_from_args(argv)
        result = deploy(spec)
    except ValueError as exc:
        print(f"deploy-lambda: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # botocore errors: one line with the code, no stack trace
        code = _code(exc)
        print(f"deploy-lambda: {code + ': ' if code else ''}{' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(result), indent=2))
    if not result.changes:
        print("deploy-lambda: everything already as configured; nothing changed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
