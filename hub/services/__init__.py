"""The hub's services: the accounting service (usage, budgets, bills, the idle culler's and the admin's pages and
API) and the jobs service (the jobs' pages and API), each a process JupyterHub runs under `/services/…`, sharing
one page frame (`accounting_service.page_templates`, the templates in `templates/`). The records they serve are in
`gpupool.hub.accounting`, one floor below."""
