"""Thin Celery tasks: validate, call the service in `workers/`, let the classifier decide."""
