"""The Nitro actor as an AWS Lambda function (container image): see handler.py and Dockerfile."""
