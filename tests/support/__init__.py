"""Test-only infrastructure, shared by the tests and the benchmarks: the Lambda Invoke API
emulator (``lambda_invoke_server``), the local-pool test actors (``actor_helpers``) and env
specs that need no emulator (``specs``).
Run from the repository root (it must be on ``sys.path``)."""
