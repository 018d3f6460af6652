"""Cloud set-up for Nitro: the Lambda actor function (deploy_lambda.py), IAM policies, Redis ACL/TLS, Prefect."""
