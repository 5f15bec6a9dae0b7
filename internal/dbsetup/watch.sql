-- fenceproxy catalog watch: event triggers that count the changes of the
-- catalog that may open a new path to a protected table (a view, a rule,
-- an inheritance or partition parent, a foreign key with a cascading
-- action), so that the proxy sees them before it forwards a write that
-- could take one. Installed by `fenceproxy setup` when its role is a
-- superuser (only superusers may create event triggers), after
-- objects.sql; every statement is idempotent.

-- One row: stamp counts the changes. A change made in a transaction counts
-- when the transaction commits, as the change itself does, so a stamp read
-- in a snapshot describes the catalog of that snapshot.
CREATE TABLE IF NOT EXISTS fenceproxy.catalog (
	one     boolean PRIMARY KEY DEFAULT true CHECK (one),
	stamp   bigint NOT NULL,
	changed timestamptz NOT NULL DEFAULT pg_catalog.now()
);
REVOKE ALL ON fenceproxy.catalog FROM PUBLIC;
GRANT SELECT ON fenceproxy.catalog TO PUBLIC;
INSERT INTO fenceproxy.catalog (one, stamp) VALUES (true, 0) ON CONFLICT (one) DO NOTHING;

-- catalog_changed() is the function of both event triggers. It counts
-- every command except those that cannot open a path (indexes, comments,
-- privileges, statistics, materialized view refreshes) and those on this
-- session's temporary objects (other sessions cannot write through them),
-- and notifies fenceproxy_catalog so that proxies check again at once.
-- ddl_command_end reports no objects for DROP: sql_drop counts those (a
-- dropped rule or INSTEAD OF trigger can make a view updatable). The
-- upsert recreates a deleted row; the proxy compares stamps for equality.
-- Concurrent transactions that change the catalog wait for each other at
-- the row, until the first one ends.
CREATE OR REPLACE FUNCTION fenceproxy.catalog_changed() RETURNS event_trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
	IF TG_EVENT = 'sql_drop' THEN
		IF NOT EXISTS (SELECT FROM pg_event_trigger_dropped_objects()
				WHERE NOT is_temporary AND object_type NOT IN ('index', 'index column', 'statistics object')) THEN
			RETURN;
		END IF;
	ELSIF TG_TAG IN ('CREATE INDEX', 'ALTER INDEX', 'REINDEX', 'COMMENT', 'GRANT', 'REVOKE',
			'ALTER DEFAULT PRIVILEGES', 'SECURITY LABEL', 'REFRESH MATERIALIZED VIEW',
			'CREATE STATISTICS', 'ALTER STATISTICS')
		OR NOT EXISTS (SELECT FROM pg_event_trigger_ddl_commands() WHERE schema_name IS DISTINCT FROM 'pg_temp') THEN
		RETURN;
	END IF;
	INSERT INTO fenceproxy.catalog AS c (one, stamp) VALUES (true, 1)
		ON CONFLICT (one) DO UPDATE SET stamp = c.stamp + 1, changed = pg_catalog.now();
	PERFORM pg_catalog.pg_notify('fenceproxy_catalog', '');
END
$body$;
REVOKE ALL ON FUNCTION fenceproxy.catalog_changed() FROM PUBLIC;
