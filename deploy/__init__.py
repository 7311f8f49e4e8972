"""Deployment: deploy/nginx.conf (nginx in front of `retrieval serve`) and its non-root launcher."""
