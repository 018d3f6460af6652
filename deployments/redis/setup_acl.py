"""Create the Redis ACL users Nitro needs (Redis >= 7: per-key read/write permissions).

    NITRO_REDIS_ADMIN_PASSWORD=... NITRO_REDIS_ACTOR_PASSWORD=... NITRO_REDIS_LEARNER_PASSWORD=... \\
    python -m deployments.redis.setup_acl --url 'rediss://default@redis.example.internal:6379/0?ssl_ca_certs=/etc/nitro/ca.pem'

* ``nitro-actor`` (the Lambda functions): reads a round's weights and writes its own batch.
  Commands: GET, SET, RPUSH, EXPIRE and EVALSHA/SCRIPT LOAD of the cache's put-batch script (SET NX +
  RPUSH + EXPIRE in one atomic step). Keys: ``nitro:*:weights`` read-only;
  ``nitro:*:batch:*``, ``nitro:*:done`` and ``nitro:*:episode:*`` read-write (Redis checks a script's declared keys for
  both read and write, so the atomic script needs RW there; without DEL/KEYS/SCAN/LRANGE the
  actor still cannot delete, list, or enumerate anything); ``nitro:*:summary:*`` write-only (its
  summary, so that a run resumed after its learner died can still bill the invocation). It
  cannot write weights, read other actors' summaries, touch keys
  outside ``nitro:*``, or run admin commands (FLUSHALL, CONFIG, KEYS, DEBUG, ...). Scripts run
  under the same ACL, so EVALSHA does not widen it.
* ``nitro-learner`` (the Prefect worker / learner): everything under ``nitro:*`` that the
  trajectory cache does (publish weights, BLPOP the done list, MGET batches, SCAN + UNLINK a
  finished round), nothing else.

Passwords are stored hashed (``#<sha256>``); the rules are the same strings ElastiCache accepts
as RBAC access strings (without the user/password part).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

ACTOR_USER = "nitro-actor"
LEARNER_USER = "nitro-learner"

ACTOR_RULES = [
    "resetkeys", "resetchannels", "-@all",
    "+ping", "+get", "+set", "+rpush", "+expire", "+evalsha", "+script|load",
    "%R~nitro:*:weights", "~nitro:*:batch:*", "~nitro:*:done", "~nitro:*:episode:*", "%W~nitro:*:summary:*",
]
LEARNER_RULES = [
    "resetkeys", "resetchannels", "-@all",
    "+ping", "+info", "+get", "+mget", "+set", "+exists", "+ttl", "+expire", "+del", "+unlink", "+scan",
    "+rpush", "+blpop", "+lpop", "+llen", "+lrange", "+evalsha", "+script|load",
    "~nitro:*",
]


def access_string(rules: list[str]) -> str:
    """The rules as one string (e.g. an ElastiCache user's AccessString: prefix it with ``on``)."""
    return " ".join(rules)


def apply_users(admin, actor_password: str, learner_password: str | None = None) -> list[str]:
    """``ACL SETUSER`` both users through an admin connection (idempotent: the rules are reset)."""
    done = []
    users = [(ACTOR_USER, actor_password, ACTOR_RULES)]
    if learner_password:
        users.append((LEARNER_USER, learner_password, LEARNER_RULES))
    for name, password, rules in users:
        if not password or len(password) < 16:
            raise ValueError(f"the password of {name} must be at least 16 characters")
        digest = hashlib.sha256(password.encode()).hexdigest()
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f"#{digest}", *rules)
        done.append(name)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.redis.setup_acl", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="admin URL, no password inside (rediss://default@host:6379/0?ssl_ca_certs=...)")
    p.add_argument("--print-access-strings", action="store_true", help="print the rules for ElastiCache RBAC and exit")
    a = p.parse_args(argv)
    if a.print_access_strings:
        print(f"{ACTOR_USER}: on {access_string(ACTOR_RULES)}")
        print(f"{LEARNER_USER}: on {access_string(LEARNER_RULES)}")
        return 0
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from nitro.cache import connect_redis

    admin = connect_redis(a.url, password_env="NITRO_REDIS_ADMIN_PASSWORD")
    names = apply_users(admin, os.environ["NITRO_REDIS_ACTOR_PASSWORD"], os.environ.get("NITRO_REDIS_LEARNER_PASSWORD"))
    print(f"ACL users set: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
