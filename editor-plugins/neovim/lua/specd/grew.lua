--- specd/suggestionGrew: specd-lsp answered with a suggestion's first line and more of it has
--- arrived since. When the notice is about the buffer's current version and the cursor still
--- there, the renderer asks again; specd-lsp serves the longer item from its cache (no model work).
local M = {}

M.METHOD = 'specd/suggestionGrew'

---@param params {uri: string, version: integer, position: {line: integer, character: integer}}
---@param client vim.lsp.Client
---@return integer? bufnr the buffer to ask again for, when the user is still where the item was shown
function M.target(params, client)
  local bufnr = vim.uri_to_bufnr(params.uri)
  if bufnr ~= vim.api.nvim_get_current_buf() or vim.fn.mode():sub(1, 1) ~= 'i' then
    return nil
  end
  local version = vim.lsp.util.buf_versions[bufnr]
  if version ~= nil and version ~= params.version then
    return nil -- typed since: the request for the new text is served on its own
  end
  local here = vim.lsp.util.make_position_params(0, client.offset_encoding).position
  if here.line ~= params.position.line or here.character ~= params.position.character then
    return nil
  end
  return bufnr
end

--- The handler for one renderer ('native' or 'plugin').
---@param renderer_name 'native'|'plugin'
function M.handler(renderer_name)
  return function(_, params, ctx)
    local client = vim.lsp.get_client_by_id(ctx.client_id)
    local bufnr = client and params and M.target(params, client)
    if bufnr then
      require(renderer_name == 'native' and 'specd.native' or 'specd.ghost').regrow(bufnr)
    end
  end
end

return M
