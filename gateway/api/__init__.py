"""The public APIs, one subpackage each: routes and request/response shapes per API."""
