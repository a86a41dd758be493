"""The CLI's requests to a cluster (`tetrad status`, `tetrad restart`): the current kubeconfig context's
(KUBECONFIG), or a pod's own account; the namespace defaults to the context's, as for kubectl. Each
request is one try bounded by a timeout, and every way it can fail is a ClusterError of one line. The
kubernetes client is an optional dependency (`tetrad[operator]`), imported only when a command runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tetrad.api.contract import GROUP, KIND, PLURAL, VERSION
from tetrad.api.manifest import shorten

REQUEST_TIMEOUT_S = 30.0  # the default bound of one request


class ClusterError(Exception):
    """The cluster cannot be asked; the message says why and what to do."""


@dataclass(frozen=True)
class Jobs:
    """The ParallelTrainingJobs of one namespace, as the kubeconfig reaches them."""

    api: Any  # kubernetes.client.CustomObjectsApi
    namespace: str
    server: str
    timeout_s: float

    def get(self, name: str) -> dict[str, Any]:
        """The job `name` as the API server returns it."""
        return self._request(name, "read", lambda: self.api.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, _request_timeout=self.timeout_s))

    def annotate(self, name: str, key: str, value: str) -> dict[str, Any]:
        """Set one annotation of the job `name` (a merge patch, as `kubectl annotate --overwrite`)."""
        body = {"metadata": {"annotations": {key: value}}}
        return self._request(name, "annotate", lambda: self.api.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, body, _request_timeout=self.timeout_s))

    def _request(self, name: str, verb: str, send: Any) -> dict[str, Any]:
        import urllib3
        from kubernetes import client

        where = f"{self.namespace}/{name}"
        try:
            job = send()
        except client.ApiException as e:
            if e.status == 404:
                raise ClusterError(f"{KIND} {where} not found (or the CRD is not installed); list the jobs"
                                   f" with `kubectl get {PLURAL} -n {self.namespace}`") from None
            raise ClusterError(f"{self.server} refused to {verb} {where}: {e.status} {e.reason}") from None
        except urllib3.exceptions.TimeoutError as e:
            # urllib3 counts a refused connection as a timeout
            if isinstance(e, urllib3.exceptions.NewConnectionError):
                raise ClusterError(f"cannot reach {self.server}: {one_line(e)}") from None
            raise ClusterError(f"{self.server} did not answer within {self.timeout_s:g} s"
                               " (--request-timeout); is it up, and is this the right cluster?") from None
        except Exception as e:  # urllib3: connection refused, TLS, a name that does not resolve
            why = one_line(getattr(e, "reason", None) or e)
            raise ClusterError(f"cannot reach {self.server}: {why}") from None
        if not isinstance(job, dict):  # a body that is not JSON: a proxy's HTML page, say
            raise ClusterError(f"{self.server} answered with something other than a Kubernetes object"
                               f" ({shorten(one_line(job), 80)}); is a proxy in the way?")
        return job


def jobs(command: str, namespace: str | None, timeout_s: float = REQUEST_TIMEOUT_S) -> Jobs:
    """The jobs of `namespace` (default: the context's, else `default`) in the cluster of the current
    kubeconfig context, or of the pod this runs in, for `tetrad COMMAND`."""
    try:
        import yaml
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
        from kubernetes.config.kube_config import KUBE_CONFIG_DEFAULT_LOCATION
    except ImportError:
        raise ClusterError(f"`tetrad {command}` needs the kubernetes Python client: pip install"
                           " 'tetrad[operator]' (or pip install kubernetes)") from None
    kubeconfig = os.environ.get("KUBECONFIG") or KUBE_CONFIG_DEFAULT_LOCATION
    try:
        config.load_kube_config()  # type: ignore[no-untyped-call]
        if namespace is None:
            _, active = config.list_kube_config_contexts()  # type: ignore[no-untyped-call]
            context = active.get("context") if isinstance(active, dict) else None
            namespace = context.get("namespace") if isinstance(context, dict) else None
    except (ConfigException, OSError) as kube_error:  # none, or not usable: a pod's own account may do
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except ConfigException:
            raise ClusterError(f"no cluster to ask ({one_line(kube_error)}): set KUBECONFIG or a context in"
                               " ~/.kube/config, or run inside a pod") from None
        namespace = namespace or _incluster_namespace()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ClusterError(f"the kubeconfig {shorten(kubeconfig, 200)} is not valid YAML{where}:"
                           f" {one_line(getattr(e, 'problem', None) or e)}; fix it or point KUBECONFIG"
                           " at another") from None
    except Exception as e:  # a kubeconfig of the wrong shape (a list for a mapping, ...)
        raise ClusterError(f"the kubeconfig {shorten(kubeconfig, 200)} cannot be used: {type(e).__name__}:"
                           f" {one_line(e)}; fix it or point KUBECONFIG at another") from None
    namespace = namespace if isinstance(namespace, str) and namespace else "default"
    settings = client.Configuration.get_default_copy()
    settings.retries = False  # one try, bounded by the timeout (urllib3 would try 4 times)
    return Jobs(client.CustomObjectsApi(client.ApiClient(settings)), namespace,
                f"the API server at {settings.host}", timeout_s)


def one_line(what: object) -> str:
    """An error's text on one line, cut at 200 characters."""
    return shorten(" ".join(str(what).split()), 200)


def _incluster_namespace() -> str | None:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None
