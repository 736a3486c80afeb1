"""The ClientApp: one client of the federation per node (node config `partition-id`); it runs the
method files' own client functions, named in each message (fl_adapter.work)."""
import fl_adapter

app = fl_adapter.client_app()
