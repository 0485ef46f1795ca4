{{- define "kvscale.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvscale.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: kvscale-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvscale
{{- end -}}

{{- define "kvscale.selectorLabels" -}}
app.kubernetes.io/name: kvscale-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvscale.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvscale.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in each namespace it serves: nothing more. */}}
{{- define "kvscale.namespacedRules" -}}
# LLMDeployments: watched and annotated by Kopf, status written by the operator.
- apiGroups: [serving.kvscale.dev]
  resources: [llmdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kvscale.dev]
  resources: [llmdeployments/status]
  verbs: [get, patch]
# The autoscaler sets replicas through the scale subresource, as an HPA would.
- apiGroups: [serving.kvscale.dev]
  resources: [llmdeployments/scale]
  verbs: [patch]
# ownerReferences with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: [serving.kvscale.dev]
  resources: [llmdeployments/finalizers]
  verbs: [update]
# The server pods' Deployment: created, updated, scaled; watched for rollout progress.
# The router's Deployment and Service (spec.router) are deleted when it is disabled.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, update, delete]
# spec.router: the router's ServiceAccount, Role and RoleBinding. Kubernetes only lets the
# operator grant what it holds itself: reading EndpointSlices and pods (below).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, update, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, update, delete]
# Pods: watched to report unschedulable or crashing replicas (get: granted to the router).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# Secrets: only checked to exist with the right keys (never listed or watched).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# One Lease per autoscaled LLMDeployment: only its holder scales it (leader election).
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, update]
{{- end -}}
