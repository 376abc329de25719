"""Where the platform touches a framework's internals: one adapter module per framework.

Ray, Ray Tune, Optuna and MLflow are used through their public APIs everywhere else. What cannot be
done that way (a private attribute, a database table, a command-line flag of one version) lives
here, in the module named after the framework, with the versions it was tested against and a
one-line error naming the installed and the tested version when they no longer match.
"""
