-- catalog_changed() as setup installed it before it counted temporary
-- views, rules and triggers (another session can write through a
-- temporary view). Kept only for comparison: a watch with this body is
-- still in place, and setup replaces it (watch.go, readWatch).
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
	ELSIF TG_TAG IN ('COMMENT', 'GRANT', 'REVOKE', 'ALTER DEFAULT PRIVILEGES', 'SECURITY LABEL',
			'REFRESH MATERIALIZED VIEW')
		-- ALTER INDEX ... RENAME renames any relation, a view or a table
		-- too: these tags count unless every object is an index or
		-- statistics object.
		OR (TG_TAG IN ('CREATE INDEX', 'ALTER INDEX', 'REINDEX', 'CREATE STATISTICS', 'ALTER STATISTICS')
			AND NOT EXISTS (SELECT FROM pg_event_trigger_ddl_commands()
				WHERE object_type NOT IN ('index', 'index column', 'statistics object')))
		OR NOT EXISTS (SELECT FROM pg_event_trigger_ddl_commands() WHERE schema_name IS DISTINCT FROM 'pg_temp') THEN
		RETURN;
	END IF;
	-- A plain UPDATE, not an upsert: ON CONFLICT DO UPDATE locks the row
	-- first, and the lock stays in the new version's xmax, which
	-- catalog_is would read as a later change.
	UPDATE fenceproxy.catalog c SET stamp = c.stamp + 1, changed = pg_catalog.now(),
		base = CASE WHEN c.writer = pg_catalog.txid_current() THEN c.base ELSE c.stamp END,
		writer = pg_catalog.txid_current();
	IF NOT FOUND THEN
		INSERT INTO fenceproxy.catalog (one, stamp, writer) VALUES (true, 1, pg_catalog.txid_current())
			ON CONFLICT (one) DO NOTHING;
	END IF;
	PERFORM pg_catalog.pg_notify('fenceproxy_catalog', '');
END
$body$;
