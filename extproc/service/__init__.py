"""The ext_proc service as Envoy meets it: the gRPC servicer and its dispatch by role (processor), the
decision filter (decision), the models endpoint (models) and the worker's status server (status).
Starting it is extproc/server.py's."""
