-- The database every kvscope table lives in. Placeholders: {database}.
CREATE DATABASE IF NOT EXISTS {database};
