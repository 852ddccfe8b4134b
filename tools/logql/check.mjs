// Reads JSON [{name, query}] on stdin; prints JSON [{name, errors: [{from, to, text}]}].
import { parser } from "@grafana/lezer-logql";

let input = "";
for await (const chunk of process.stdin) input += chunk;
const out = JSON.parse(input).map(({ name, query }) => {
  const errors = [];
  parser.parse(query).iterate({
    enter(node) {
      if (node.type.isError) {
        errors.push({ from: node.from, to: node.to, text: query.slice(node.from, node.to + 10) });
      }
    },
  });
  return { name, errors };
});
process.stdout.write(JSON.stringify(out));
